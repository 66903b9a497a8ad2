"""The command line. grpo.py's one call: flags.parse(Config, argv, ...) (grpo.parse_args) -> its Config.

flags.py      argparse from the flat Config: each field a flag, its comment the help; the rules
presets.py    the embedded run's, the paper models', --paper-batch's and LoRA's values, with sources
flag_file.py  a --config YAML or JSON file of flags (a run's run_config.json too)
resume.py     what --resume reads from the saved run and what it may change
helptext.py   how a script's help reads beyond its flags
trl_setup.py  grpo.py's flags and defaults on TRL's GRPOConfig (flowtracer_trl.py)"""
