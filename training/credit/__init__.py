"""Every credit but the paper's default (flow, top-k: flowtracer.py, in grpo.update's own lines). grpo.py's
one call: baselines.OtherCredit(run, batch, trained, adv), then other(mb, sub, cap, ent) -> flowtracer.Credit.

    baselines.py  the baselines' knobs, the token classes, assign (the TRL plug-in's call) and OtherCredit
    scoring.py    the signals: how much each response token matters, one function per criterion
    shaping.py    the rules that turn a signal's scores into the weight gamma
    oar.py        OAR-P and OAR-G: a token's effect on the model's outcome
    attention.py  eq. 1's maps from a forward of their own, or from one you do not call (TRL's)"""
