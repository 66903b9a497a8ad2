"""What data.py serves tasks from: answer checking, the arithmetic and Countdown generators, prompts."""
