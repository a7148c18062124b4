"""Small synthetic traces in Mooncake's format, with the structure of the real ones:
prefix-shared chains (conversations that grow turn by turn from shared system
prompts), one-hit blocks (a tail no later request reuses) and a hot set (a few
prompts nearly every request starts with). Deterministic for a seed; the project
commits no real trace (they are data from elsewhere)."""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["synthetic_lines", "write_trace"]


def synthetic_lines(requests: int = 200, seed: int = 0, hot: int = 3,
                    conversations: int = 20) -> list[str]:
    """JSONL lines of ``requests`` requests (see the module docstring)."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prompts = [fresh(rng.randint(2, 4)) for _ in range(hot)]  # the hot set
    chats: list[list[int]] = [rng.choice(prompts) + fresh(rng.randint(1, 3))
                              for _ in range(conversations)]
    lines = []
    for i in range(requests):
        c = rng.randrange(len(chats))
        if rng.random() < 0.25:  # a one-off question on a hot prompt: one-hit tail
            ids = rng.choice(prompts) + fresh(rng.randint(1, 6))
        else:  # the next turn of a conversation: its whole history, then new blocks
            chats[c] = chats[c] + fresh(rng.randint(1, 3))
            ids = chats[c]
        lines.append(json.dumps({"timestamp": i * 10, "input_length": 512 * len(ids),
                                 "output_length": rng.randint(1, 500), "hash_ids": ids}))
    return lines


def write_trace(path: Path, lines: list[str]) -> Path:
    """Write ``lines`` to ``path`` (xz-compressed when it ends in ``.xz``)."""
    text = "\n".join(lines) + "\n"
    if path.name.endswith(".xz"):
        import lzma
        with lzma.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path
