"""The code a user hands us, bounded. The step reaches it through data.batch_reward(run.task.reward, ...).

reward_code.py   --reward functions in either form (per row, or TRL's), their values checked
reward_files.py  each --reward file's path and hash, recorded and checked on --resume
guard.py         a call of the user's code that never returns, stopped by Ctrl-C or SIGTERM"""
