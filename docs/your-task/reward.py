"""The reward of docs/your-task.md: 1 when the last number of the reply is the row's solution, else 0."""

import re


def exact_number(completion: str, record: dict) -> float:
    numbers = re.findall(r"-?\d+", completion)  # every integer the reply writes
    return float(bool(numbers) and int(numbers[-1]) == record["solution"])
