"""Reward scoring: the stage between generation and the trainer for prompts that name a `reward_fn`.

- `job`: what runs a reward function over one group (on an RQ worker, or inline), with JSON in and out;
- `backend`: the narrow interface the stage talks to, and the factory that picks one;
- `inline`: run it in the stage's own process (threads), the default, for cheap rewards;
- `rq_backend`: run it as RQ jobs on a pool of CPU workers, for slow or untrusted reward code;
- `stage`: the leased reader of `{ns}:scoring` that assembles groups and forwards them scored;
- `text`: the replies decoded with a tokenizer (`rollouts scorer --tokenizer DIR`), for rewards that read `text`.
"""
