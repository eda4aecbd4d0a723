"""Tasks with verifiable rewards, for the reference trainer, the scoring stage and the demo.

- `token_set`: the task the random tiny model measurably learns (`TokenSetTask`, `token_set_reward`), on token ids;
- the task library, on text (a reply decoded): `arithmetic` (named levels, `sum-1d` the easiest), `word_problems`
  (GSM-style, from templates) and `countdown` (reach a target from given numbers), each with a seeded generator, a
  held-out eval split (`base`), an answer parser (`answers`, `countdown`) and an exact-match reward with an optional
  format reward; `registry` (`get_task`, `TASKS`) and `rewards` (`exact_match` for the scoring stage, `score_text`
  for a trainer). docs/guide/tasks.md says how to use them.
"""

from producers.tasks.base import Problem, Split, Task, split_of
from producers.tasks.registry import TASKS, get_task
from producers.tasks.rewards import score_text, text_reward
from producers.tasks.token_set import TokenSetTask, token_set_reward

__all__ = [
    "TASKS",
    "Problem",
    "Split",
    "Task",
    "TokenSetTask",
    "get_task",
    "score_text",
    "split_of",
    "text_reward",
    "token_set_reward",
]
