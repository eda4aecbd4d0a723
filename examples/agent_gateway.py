"""An agent that talks to `rollouts gateway` through the official `openai` client, as any agent code does.

    rollouts worker --model ./tiny &
    rollouts gateway --model ./tiny --port 8000 &
    python examples/agent_gateway.py --base-url http://127.0.0.1:8000/v1 --session task-1

Calls that carry one `X-Session-ID` are the turns of one session: they run on the worker that holds its prefix, and
the gateway keeps the trajectory token for token (the model's own tokens, never re-tokenized). Finishing the session
with a reward (`POST /v1/sessions/{id}/finish`) sends that trajectory to the trainer, which reads it from
`RolloutClient.groups()` like any other rollout.
"""

from __future__ import annotations

import argparse

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam


def calculator(a: int, b: int) -> str:
    """The agent's tool: what it tells the model between two turns."""
    return f"calculator: {a} + {b} = {a + b}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's /v1")
    parser.add_argument("--session", default="task-1", help="this conversation's id (X-Session-ID)")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key="unused")  # the gateway asks for no key
    model = client.models.list().data[0].id  # the name the gateway serves the workers' model under
    session = {"X-Session-ID": args.session}
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 + 30?"},
    ]
    for turn in range(2):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=16,
            extra_headers=session,
        )
        text = reply.choices[0].message.content or ""
        print(f"turn {turn}: {text!r}")
        messages.append({"role": "assistant", "content": text})
        if turn == 0:
            messages.append({"role": "tool", "content": calculator(12, 30), "tool_call_id": "call-0"})
    reward = float("42" in text)  # the last reply
    done = httpx.post(f"{args.base_url}/sessions/{args.session}/finish", json={"reward": reward}, timeout=30)
    done.raise_for_status()
    print(f"finished {args.session} with reward {reward}: {done.json()}")


if __name__ == "__main__":
    main()
