"""Real optimizer steps of a real model, for what depends on how versions differ (`TrainingSteps`): the delta probe
(`probes/delta_sync.py`) and `bench-sync --deltas`.

Each step is a real AdamW step (the real demo's 2e-5, betas 0.9/0.99) on the real model: cross-entropy on the
chat-templated answers of one-digit sums (`arithmetic:sum-1d`), 8 problems a step. Not GRPO's loss: what decides how
many bf16 elements an AdamW step changes is its update's size (~the learning rate for every element with a gradient),
which it shares. The parameters are trained in `dtype` itself (bf16: as `bench-rl --trainer-dtype bfloat16` trains
them; a step moves an element only where the update passes half its ULP).
"""

from __future__ import annotations

from pathlib import Path

import torch

TASK = "arithmetic:sum-1d"
PROBLEMS_A_STEP = 8
LEARNING_RATE = 2e-5


class TrainingSteps:
    """A model loaded from `model_dir` in `dtype` on `device`, and `step()`: one real optimizer step of it."""

    def __init__(
        self, model_dir: Path, dtype: torch.dtype, device: str = "cpu", lr: float = LEARNING_RATE, seed: int = 0
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from producers.tasks import get_task

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)  # type: ignore[arg-type]  # transformers' @wraps on .to: mypy reads it unbound
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99))
        self.task = get_task(TASK)
        self.device, self.seed, self.steps = device, seed, 0

    def step(self) -> float:
        """One AdamW step on the next batch of problems; returns its loss."""
        problems = self.task.problems("train", PROBLEMS_A_STEP, seed=self.seed * 1000 + self.steps)
        chats = [[*p.messages, {"role": "assistant", "content": p.answer}] for p in problems]
        if self.tokenizer.chat_template:
            texts = [self.tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
        else:  # a test's tiny model: the turns one after another
            texts = [" ".join(str(turn["content"]) for turn in chat) for chat in chats]
        batch = self.tokenizer(texts, return_tensors="pt", padding=True).to(self.device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = self.model(**batch, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        return float(loss.detach())
