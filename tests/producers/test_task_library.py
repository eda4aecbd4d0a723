"""The task library (`producers.tasks`): problems with known answers at named levels, a held-out split that no seed
crosses, parsers that read what a model writes and refuse what it should not, and rewards as the scoring stage, a
trainer and a prompt's `meta` use them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.scoring.job import rollout_view, score_group
from pipeline.codec import for_redis
from pipeline.local import RedisServer
from pipeline.processes import start_command, stop_process
from pipeline.wire import Rollout
from producers.client import RolloutClient
from producers.tasks import TASKS, Problem, TokenSetTask, get_task, score_text, split_of, text_reward
from producers.tasks.answers import parse_number, tagged_number
from producers.tasks.arithmetic import LEVELS as ARITHMETIC_LEVELS
from producers.tasks.countdown import Refused, check, evaluate, parse_expression
from producers.tasks.rewards import FORMAT_WEIGHT

EXACT = "producers.tasks.rewards:exact_match"
WITH_FORMAT = "producers.tasks.rewards:exact_match_with_format"
TIMES = "\u00d7"  # the multiplication sign
SUM_7 = {"task": "arithmetic", "level": "sum-1d", "answer": "7"}


def view(text: str | None, meta: dict[str, Any], sample: int = 0) -> dict[str, Any]:
    """What the scoring stage hands a reward function (`rollout_view`), with `text` where it has a tokenizer."""
    rollout = Rollout(prompt_id="p", sample=sample, n=1, version=0, version_end=0, finish_reason="stop", worker="w",
                      prompt_tokens=[1], tokens=[2], logprobs=[-1.0], spans=[(0, 0, 1)], meta=meta)  # fmt: skip
    return rollout_view(rollout, text=text)


# -- the numeric parser --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "number"),
    [
        ("7 + 5 = 12", 12),
        ("I add them. The answer is 12.", 12),
        ("Answer: 1,234.", 1234),
        ("Answer: -3", -3),
        ("x = -3", -3),
        ("Answer: 7.", 7),
        ("Answer: 7.5", Fraction(15, 2)),
        ("Answer: 5.0", 5),
        ("**Answer:** $1,234,567", 1234567),
        ("answer: 8", 8),
        ("Answer: 12 (I checked: 5 + 7 = 12, not 13)", 12),
        ("Answer: 3. Wait, no.\nAnswer: 4", 4),
        ("Answer:\n\n42", 42),
        ("Answer: I am not sure, maybe 9 or 10", 9),
        ("It is 5 apples. Answer: none", 5),
        ("5-3", 3),
        ("12,34", 34),
        ("1,2345", 2345),
        ("First 3, then 4, finally 9 and done", 9),
    ],
)
def test_the_parser_takes_the_number_after_the_last_answer_tag_else_the_last_number(
    reply: str, number: Fraction | int
) -> None:
    assert parse_number(reply) == number


@pytest.mark.parametrize("reply", ["", "no number here", "Answer: seven", "--", "1" * 500, "Answer: ,", "-."])
def test_a_reply_without_a_number_parses_to_none(reply: str) -> None:
    assert parse_number(reply) is None


@pytest.mark.parametrize(
    ("reply", "follows"),
    [
        ("Answer: 1,234.", True),
        ("**Answer:** $12", True),
        ("So 3 + 4 = 7.\nAnswer: 7", True),
        ("Answer: about 12", False),
        ("Answer:\n12", False),
        ("12", False),
        ("Answer: 12\nAnswer: twelve", False),  # the last tag is the one that counts
    ],
)
def test_the_format_rule_wants_a_number_right_after_the_last_answer_tag(reply: str, follows: bool) -> None:
    assert (tagged_number(reply) is not None) is follows


def test_a_trailing_period_is_not_a_decimal_and_a_decimal_is_not_its_integer_part() -> None:
    task = get_task("arithmetic:sum-1d")
    assert task.reward("Answer: 7.", SUM_7) == 1.0
    assert task.reward("Answer: 7.5", SUM_7) == 0.0
    assert task.reward("Answer: 7.0", SUM_7) == 1.0


@given(st.integers(min_value=-(10**12), max_value=10**12), st.text(alphabet="abc xyz.,;:\n", max_size=30))
def test_any_integer_written_with_or_without_thousands_commas_reads_back(value: int, prose: str) -> None:
    for written in (f"{value}", f"{value:,}"):
        assert parse_number(f"{prose} Answer: {written}.") == value


@settings(max_examples=300)
@given(st.text(max_size=200))
def test_no_text_makes_a_parser_or_a_reward_raise(text: str) -> None:
    parse_number(text)
    parse_expression(text)
    for name in ("arithmetic:sum-1d", "word-problems", "countdown"):
        problem = get_task(name).problems("train", 1, seed=0)[0]
        assert score_text(text, problem.meta, format_weight=0.5) in (0.0, 0.5, 1.0, 1.5)


# -- levels, and answers that are right ----------------------------------------------------------

ARITHMETIC = {
    # level: operands, their range, the operators that may appear
    "sum-1d": (2, range(0, 10), {"+"}),
    "times-table": (2, range(2, 13), {TIMES}),
    "sum-2d": (2, range(10, 100), {"+"}),
    "sum-3d": (2, range(100, 1000), {"+"}),
    "ops-2": (3, range(1, 10), {"+", "-", TIMES}),
    "ops-3": (4, range(1, 10), {"+", "-", TIMES}),
    "ops-3-2d": (4, range(10, 100), {"+", "-", TIMES}),
}


def test_the_arithmetic_levels_are_the_named_ones_from_one_digit_sums_up() -> None:
    assert set(ARITHMETIC) <= set(ARITHMETIC_LEVELS)
    assert TASKS[0] == "arithmetic:sum-1d" and get_task("arithmetic").name == "arithmetic:sum-1d"
    assert {"word-problems:mixed", "countdown:n3", "countdown:n4"} <= set(TASKS)


@pytest.mark.parametrize("level", list(ARITHMETIC))
def test_every_arithmetic_problem_has_the_answer_python_computes_from_its_question(level: str) -> None:
    count, values, operators = ARITHMETIC[level]
    task = get_task(f"arithmetic:{level}")
    for split in ("train", "eval"):
        for problem in task.problems(split, 15, seed=3):
            m = re.fullmatch(r"What is (.+)\?", problem.question)
            assert m, problem.question
            tokens = m.group(1).split(" ")
            numbers, shown = [int(t) for t in tokens[::2]], set(tokens[1::2])
            assert len(numbers) == count and all(n in values for n in numbers) and shown <= operators, problem
            assert int(problem.answer) == eval(m.group(1).replace(TIMES, "*"))  # our own question text: trusted
            assert problem.meta == {**problem.meta, "task": "arithmetic", "level": level, "answer": problem.answer}
            assert problem.messages == [{"role": "user", "content": problem.prompt}]
            assert problem.prompt.endswith("Give the final answer as a number after 'Answer:'.")
            assert task.reward(f"So it is... Answer: {problem.answer}", problem.meta) == 1.0


WORD: dict[str, tuple[str, Callable[..., int | None]]] = {
    # template: how to read its numbers back from the text, and the answer from them
    "more": (r"has (\d+) \w+ and buys (\d+) more", lambda a, b: a + b),
    "give-away": (r"has (\d+) \w+ and gives (\d+) of them", lambda a, b: a - b),
    "share": (r"shares (\d+) \w+ equally among (\d+) friends", lambda total, k: total // k if total % k == 0 else None),
    "buy": (r"buys (\d+) [\w ]+ that cost (\d+) dollars each", lambda k, p: k * p),
    "rate": (r"makes (\d+) \w+ every hour\. How many \w+ does it make in (\d+) hours", lambda r, h: r * h),
    "change": (r"has (\d+) dollars and buys (\d+) [\w ]+ at (\d+) dollars each", lambda m, k, p: m - k * p),
    "packs": (r"has (\d+) \w+\. Then \w+ buys (\d+) packs with (\d+)", lambda a, k, c: a + k * c),
    "wages": (r"earns (\d+) dollars an hour and works (\d+) hours a day for (\d+) days", lambda r, h, d: r * h * d),
}


@pytest.mark.parametrize("level", ["mixed", "one-step", "two-step"])
def test_every_word_problem_has_the_answer_its_text_gives(level: str) -> None:
    seen: Counter[str] = Counter()
    for problem in get_task(f"word-problems:{level}").problems("train", 200, seed=1):
        template = problem.meta["template"]
        pattern, answer = WORD[template]
        m = re.search(pattern, problem.question)
        assert m, problem.question
        expected = answer(*map(int, m.groups()))
        assert expected is not None and expected >= 0 and problem.answer == str(expected), problem.question
        assert problem.question.endswith("?") and "{" not in problem.question
        seen[template] += 1
    steps = {"one-step": {"more", "give-away", "share", "buy", "rate"}, "two-step": {"change", "packs", "wages"}}
    assert set(seen) == steps.get(level, set(WORD)), seen


@pytest.mark.parametrize("level", ["n3", "n4"])
def test_every_countdown_target_is_reached_by_its_answer_from_its_numbers(level: str) -> None:
    for problem in get_task(f"countdown:{level}").problems("train", 100, seed=2):
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        assert len(numbers) == int(level[1]) and all(1 <= n <= 25 for n in numbers)
        assert 2 <= target <= 999 and target not in numbers
        assert eval(problem.answer) == target  # our own expression: trusted
        assert sorted(map(int, re.findall(r"\d+", problem.answer))) == sorted(numbers)
        assert f"equal to {target}." in problem.question and problem.prompt.endswith("after 'Answer:'.")
        assert get_task("countdown").reward(f"Answer: {problem.answer}", problem.meta) == 1.0


# -- the held-out split --------------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_train_and_eval_never_share_a_problem_whatever_the_seeds(name: str) -> None:
    task = get_task(name)
    count = 12
    train = [p for seed in range(25) for p in task.problems("train", count, seed=seed)]
    held = [p for seed in range(25) for p in task.problems("eval", count, seed=seed)]
    assert {p.id for p in train}.isdisjoint(p.id for p in held)
    assert {task.split_key(p) for p in train}.isdisjoint(task.split_key(p) for p in held)
    assert {p.question for p in train}.isdisjoint(p.question for p in held)
    assert all(split_of(task.split_key(p)) == "eval" for p in held)  # one fixed pool, whatever the seed
    assert len({p.id for p in held}) > count, "other seeds draw other eval problems"


@pytest.mark.parametrize("name", ["arithmetic:sum-1d", "arithmetic:times-table"])
def test_a_small_level_holds_out_a_fixed_fifth_that_every_seed_draws_from(name: str) -> None:
    task = get_task(name)
    listed = task.all_problems()
    assert listed is not None
    pool = {p.id for p in listed if task.split(p) == "eval"}
    assert 0.1 * len(listed) <= len(pool) <= 0.3 * len(listed)
    for seed in range(5):
        assert {p.id for p in task.problems("eval", len(pool), seed=seed)} == pool
    with pytest.raises(ValueError, match=rf"{name} has {len(pool)} eval problems: ask for at most {len(pool)}"):
        task.problems("eval", len(pool) + 1)


def test_a_sum_and_the_same_sum_swapped_are_held_out_together() -> None:
    task = get_task("arithmetic:sum-1d")
    listed = task.all_problems() or []
    by_question = {p.question: task.split(p) for p in listed}
    pairs = [(a, b) for a in range(10) for b in range(10)]
    assert all(by_question[f"What is {a} + {b}?"] == by_question[f"What is {b} + {a}?"] for a, b in pairs)


@pytest.mark.parametrize("name", TASKS)
def test_the_same_seed_draws_the_same_problems_and_another_seed_others(name: str) -> None:
    task = get_task(name)
    first, again = task.problems("train", 10, seed=7), task.problems("train", 10, seed=7)
    assert first == again and len({p.id for p in first}) == 10
    assert [p.id for p in task.problems("train", 10, seed=8)] != [p.id for p in first]


def test_problem_ids_and_texts_are_the_same_in_another_interpreter() -> None:
    """Not Python's `hash()` (salted per process): a held-out problem stays held out across runs and machines."""
    code = (
        "from producers.tasks import get_task\n"
        "for name in ('arithmetic:ops-3', 'word-problems', 'countdown:n4'):\n"
        "    print(*(p.id + '|' + p.question for p in get_task(name).problems('eval', 5, seed=11)), sep='\\n')\n"
    )
    here = [f"{p.id}|{p.question}" for n in ("arithmetic:ops-3", "word-problems", "countdown:n4")
            for p in get_task(n).problems("eval", 5, seed=11)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONHASHSEED": "123"}
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert there.stdout.splitlines() == here


def test_a_problem_asks_its_question_and_the_instruction_in_one_user_message() -> None:
    [problem] = get_task("arithmetic:sum-1d").problems("train", 1, seed=0)
    assert isinstance(problem, Problem) and problem.id.startswith("arithmetic:sum-1d:")
    instruction = "Give the final answer as a number after 'Answer:'."
    assert problem.messages == [{"role": "user", "content": f"{problem.question} {instruction}"}]


# -- countdown's verifier ------------------------------------------------------------------------

GIVEN = [8, 3, 8, 3]


@pytest.mark.parametrize(
    ("reply", "right"),
    [
        ("Answer: 8 / (3 - 8 / 3)", True),  # exact fractions: 24
        ("Answer: (8 - 3) * 3 + 8 + 1", False),  # 1 is not given
        ("Answer: 8 * 3", True),  # not every number need be used
        ("Answer: 8 * 3 * 1", False),
        ("Answer: 3 * 8 = 24", True),
        (f"**Answer:** `8 {TIMES} 3`.", True),
        ("First 8 + 8 = 16\nthen 3 * 8 = 24", True),  # no tag: the last line with an '='
        ("8 + 8 = 16, and `3 * 8` = 24 is it", False),  # one line: its first '='
        ("Answer: 24", False),  # the target itself is not a given number
        ("Answer: 8 * 3 * 8 / 8", False),  # 8 three times, given twice
        ("Answer: (3 + 3) * (8 - 8 / 8 * 3 - 1)", False),
        ("Answer: 8 * 3 + 0", False),
        ("Answer: 8 / (3 - 3)", False),  # division by zero
        ("Answer: 2**3 * 3", False),
        ("Answer: -8 * -3", False),  # no unary signs
        ("Answer: 8.0 * 3", False),
        ("Answer: __import__('os').getpid()", False),
        ("no expression at all", False),
    ],
)
def test_countdown_takes_an_expression_of_the_given_numbers_each_at_most_once(reply: str, right: bool) -> None:
    meta = {"task": "countdown", "level": "n4", "answer": "8 / (3 - 8 / 3)", "numbers": GIVEN, "target": 24}
    assert get_task("countdown:n4").reward(reply, meta) == (1.0 if right else 0.0)


@pytest.mark.parametrize(
    "attack",
    [
        "__import__('os').system('touch {marker}')",
        "open('{marker}', 'w').write('x')",
        "(lambda: __import__('os').system('touch {marker}'))()",
        "[c for c in ().__class__.__base__.__subclasses__()]",
        "exec(\"open('{marker}', 'w')\")",
    ],
)
def test_countdown_never_runs_what_a_reply_writes(attack: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    expression = attack.format(marker=marker)
    with pytest.raises(Refused):
        evaluate(expression)
    assert not check(expression, [1, 2, 3], 6)
    meta = {"task": "countdown", "level": "n3", "answer": "1 + 2 + 3", "numbers": [1, 2, 3], "target": 6}
    assert score_text(f"Answer: {expression}", meta, format_weight=0.5) == 0.0
    assert not marker.exists()


def test_countdown_refuses_an_expression_too_long_or_malformed() -> None:
    with pytest.raises(Refused, match="longer than"):
        evaluate("+".join(["1"] * 150))
    with pytest.raises(Refused, match="not an expression"):
        evaluate("(" * 99 + "1" + ")" * 98)
    assert evaluate("(" * 90 + "1 + 2" + ")" * 90) == (3, [1, 2])


# -- rewards as the scoring stage, a prompt's meta and a trainer use them ------------------------


def test_the_scoring_stage_reward_dispatches_on_the_meta_and_scores_one_or_zero() -> None:
    [word] = get_task("word-problems").problems("train", 1, seed=4)
    [count] = get_task("countdown").problems("train", 1, seed=4)
    group = [
        view("3 + 4 = 7\nAnswer: 7", SUM_7),
        view("Answer: 8", SUM_7, sample=1),
        view(f"So... Answer: {word.answer}", word.meta, sample=2),
        view(f"Answer: {count.answer}", count.meta, sample=3),
        view("Answer: 1 + 1", count.meta, sample=4),
        view("\x00\ufffd garbage ))) Answer:", SUM_7, sample=5),
    ]
    assert score_group(EXACT, group) == {"rewards": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]}


def test_the_format_reward_adds_its_weight_for_an_answer_line_right_or_wrong() -> None:
    group = [view("Answer: 7", SUM_7), view("it is 7", SUM_7), view("Answer: 6", SUM_7), view("it is 6", SUM_7)]
    assert score_group(WITH_FORMAT, group) == {"rewards": [1 + FORMAT_WEIGHT, 1.0, FORMAT_WEIGHT, 0.0]}
    weighted = {**SUM_7, "format_weight": 0.5}
    assert score_group(WITH_FORMAT, [view("Answer: 6", weighted)]) == {"rewards": [0.5]}
    assert score_group(EXACT, [view("Answer: 6", weighted)]) == {"rewards": [0.0]}, "exact_match has no format part"


def test_a_view_without_text_fails_the_group_saying_to_give_the_scorer_a_tokenizer() -> None:
    result = score_group(EXACT, [view(None, SUM_7)])
    assert set(result) == {"error"} and "\n" not in result["error"]
    assert "needs the reply's text: start the scorer with --tokenizer DIR" in result["error"]
    assert "text" not in view(None, SUM_7), "a stage without a tokenizer passes no text"


def test_a_meta_of_no_known_task_is_an_error_that_names_the_known_ones() -> None:
    result = score_group(EXACT, [view("Answer: 7", {"task": "chess", "answer": "e4"})])
    assert "unknown task 'chess': one of arithmetic:sum-1d" in result["error"]
    assert "names no task" in score_group(EXACT, [view("Answer: 7", {})])["error"]
    with pytest.raises(ValueError, match=r"unknown task 'arithmetic:sum-9d': one of .*countdown:n4 \(or a family"):
        get_task("arithmetic:sum-9d")
    assert get_task("word-problems").name == "word-problems:mixed" and get_task("countdown").name == "countdown:n3"


def test_a_trainer_scores_text_in_process_and_rollouts_through_its_tokenizer() -> None:
    assert score_text("Answer: 7", SUM_7) == 1.0 and score_text("Answer: 7", SUM_7, format_weight=0.2) == 1.2
    words = {2: "Answer:", 3: " 7", 4: " 8"}
    reward = text_reward(lambda ids: "".join(words[i] for i in ids))
    rollout = Rollout(prompt_id="p", sample=0, n=1, version=0, version_end=0, finish_reason="stop", worker="w",
                      prompt_tokens=[1], tokens=[2, 3], logprobs=[-1.0] * 2, spans=[(0, 0, 2)], meta=SUM_7)  # fmt: skip
    assert reward(rollout) == 1.0
    rollout.tokens = np.asarray([2, 4], dtype=np.int32)
    assert reward(rollout) == 0.0


def test_the_token_set_task_keeps_its_import_paths() -> None:
    ids = TokenSetTask().set_ids(0)
    sample = {"tokens": [ids[0], 300], "finish_reason": "length", "meta": {"ids": ids}}
    assert score_group("producers.tasks:token_set_reward", [sample]) == {"rewards": [0.5]}


# -- through the real scoring stage, with a tokenizer --------------------------------------------


def test_a_scorer_given_a_tokenizer_scores_the_decoded_reply(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`rollouts scorer --tokenizer DIR`: a reply whose tokens say "Answer: 7" gets 1.0, one that says 8 gets 0.0."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    client = RolloutClient(redis_server.url, ns)
    replies = ["3 + 4 = 7. Answer: 7", "Answer: 8"]
    for sample, reply in enumerate(replies):
        tokens = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]  # special: skipped
        rollout = Rollout(prompt_id="sum", sample=sample, n=2, version=0, version_end=0, finish_reason="stop",
                          worker="w", prompt_tokens=[5, 6], tokens=tokens, logprobs=[-1.0] * len(tokens),
                          spans=[(0, 0, len(tokens))], meta=SUM_7, reward_fn=EXACT)  # fmt: skip
        client.streams.redis.xadd(client.streams.keys.scoring, for_redis(rollout.to_fields()))
    log = tmp_path / "scorer.log"
    scorer = start_command("scorer", "--redis", redis_server.url, "--ns", ns, "--tokenizer", str(tiny_model_dir),
                           "--name", "scorer-text", log_file=log)  # fmt: skip
    try:
        [group] = client.collect(1, timeout=90)
    finally:
        stop_process(scorer, timeout_s=15)
    assert group.reward_error is None, log.read_text()
    assert group.rewards == [1.0, 0.0]
    assert f"decoding with {tiny_model_dir}" in " ".join(log.read_text().split()), log.read_text()


def test_a_scorer_refuses_a_tokenizer_directory_without_one_in_one_line(tmp_path: Path) -> None:
    command = ["scorer", "--redis", "redis://127.0.0.1:1", "--tokenizer", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "rollouts", *command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert " ".join(done.stderr.split()) == (
        f"error: --tokenizer {tmp_path}: no tokenizer there (tokenizer_config.json or tokenizer.json missing)"
    )
