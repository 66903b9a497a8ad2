"""What a refactor must not change, recorded from main at 570f290 and compared here.

1. Every --credit x --shaping choice that baselines.check accepts (111 of them) gives the same gamma on one
   fixed batch: tiny-qwen3 in fp32 on the CPU, as grpo.py's setup loads it (seeded), 8 rows in 2 groups
   of 4, one grpo.update. The tolerance is 1e-6 absolute on gamma (values near 1): the same fp32 ops on
   one thread give the same bits; the slack only absorbs a reduction regrouped by a library upgrade. A
   real change of a rule moves gamma by far more (a boosted token is 1.5, not 1).
2. The default run's rewards per step, (0.125, 0.125, 0, 0.125, 0, 0.5): `python grpo.py` on the embedded
   model. The run takes ~2 minutes, so the suite does not repeat it: .ci/run runs the README's command and
   then this test on its run directory (FLOWTRACER_DEFAULT_RUN); elsewhere it skips with that reason.

Record again (only when a change of the numbers is intended, and say so in the commit):
    python tests/test_regression.py --record
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
GOLDEN = HERE / "golden" / "credit_gamma.json"
DEFAULT_REWARDS = [0.125, 0.125, 0.0, 0.125, 0.0, 0.5]  # python grpo.py at 570f290, steps 1-6

PROMPTS = ["Q: 2+2=?", "Q: 9*9?"]
RESPONSES = [
    "so it is 4, answer \\boxed{4} ok",
    "four: \\boxed{4}",
    "two and two make \\boxed{5}",
    "\\boxed{4} it is, as 2+2=4",
    "nine nines, so \\boxed{81}",
    "\\boxed{18} it is",
    "eighty-one: 9*9 = \\boxed{81}.",
    "81 or so",
]
ADV = [1.0, -1.0, -0.5, 0.5, 1.0, -1.0, 0.5, 0.0]  # one row with A = 0: not trained (departure 7)


def choices():
    """(credit, shaping) of every pair baselines.check accepts, in the order of SIGNALS and SHAPINGS."""
    import grpo
    from training.credit import baselines, scoring, shaping

    return [
        (c, s)
        for c in scoring.SIGNALS
        for s in shaping.SHAPINGS
        if baselines.check(grpo.Config(credit=c, shaping=s)) is None
    ]


def gamma_of(credit_name, shaping_name):
    """gamma (B, R) of one grpo.update of the fixed batch under --credit credit_name --shaping
    shaping_name."""
    import grpo
    from data import build_batch
    from training.run import log
    from training.run.setup import load_for_update

    cfg = grpo.parse_args(
        [
            "--model",
            "tiny-qwen3",
            "--micro-batch",
            "4",
            "--no-grad-checkpointing",
            "--device",
            "cpu",
            "--credit",
            credit_name,
            "--shaping",
            shaping_name,
        ]
    )
    torch.manual_seed(cfg.seed)  # as setup seeds before the model loads
    run = load_for_update(cfg, torch.device("cpu"))
    tok = run.policy.tok
    batch = build_batch(
        tok,
        [tok(PROMPTS[j // 4]).input_ids for j in range(8)],
        [tok(r).input_ids + [tok.eos_token_id] for r in RESPONSES],
    )
    adv = torch.tensor(ADV)
    trained = (adv != 0).nonzero().flatten().tolist()
    return grpo.update(run, batch, trained, adv, log.Clock("cpu")).weight  # (B, R)


@pytest.mark.slow
def test_every_credit_and_shaping_gives_the_recorded_gamma():
    want = json.loads(GOLDEN.read_text())
    got = choices()
    assert len(got) == len(want) == 111 and [list(x) for x in got] == [w["choice"] for w in want]
    changed = []
    for (c, s), w in zip(got, want):
        gamma = gamma_of(c, s)
        ref = torch.tensor(w["gamma"])
        if gamma.shape != ref.shape or not torch.allclose(gamma, ref, rtol=0, atol=1e-6):
            changed.append(f"{c}/{s}")
    assert not changed, f"gamma changed for {len(changed)} choice(s): {', '.join(changed)}"
    boosted = [w for w in want if any(g not in (0.0, 1.0) for row in w["gamma"] for g in row)]
    assert len(boosted) > 80  # not vacuous: most choices weight some token other than 1


def test_default_run_gives_the_recorded_rewards():
    run = os.environ.get("FLOWTRACER_DEFAULT_RUN")
    if not run:
        pytest.skip(
            "needs the default run's directory: .ci/run runs `python grpo.py` and then this test "
            "with FLOWTRACER_DEFAULT_RUN set"
        )
    lines = [json.loads(x) for x in open(Path(run) / "metrics.jsonl")]
    assert [m["step"] for m in lines] == list(range(1, 7))
    assert [m["reward/mean"] for m in lines] == pytest.approx(DEFAULT_REWARDS, abs=1e-9)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    torch.set_num_threads(1)
    GOLDEN.parent.mkdir(exist_ok=True)
    rows = [{"choice": [c, s], "gamma": gamma_of(c, s).tolist()} for c, s in choices()]
    GOLDEN.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    print(f"{GOLDEN}: {len(rows)} choices")
