"""A tiny TRL 1.16 GRPOTrainer run on CPU and offline: the example's random-weight Qwen2 (hidden 32, 2 layers),
character-level tokenizer and Python reward (examples/trl_capture.py), and a small `datasets.Dataset`.
`run(store, **options)` trains it for a few steps with capture on and returns the capture handle."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from examples.trl_capture import model, reward, tokenizer  # noqa: E402
from trajectory_replay.integrations.trl import TrlCapture, enable_capture  # noqa: E402

PROMPTS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


def reward_or_none(completions: list[str], **kwargs: Any) -> list[float | None]:
    """`reward`, but None (unscorable) for every completion that holds an 'e'."""
    return [None if "e" in c else float(c.count("a")) + 0.1 * len(c) for c in completions]


def trainer(
    output_dir: str,
    *,
    steps: int = 2,
    reward_funcs: Callable[..., Any] | list[Callable[..., Any]] = reward,
    **options: Any,
) -> GRPOTrainer:
    """A GRPOTrainer of 2 prompts x 4 generations per step (8 completions of at most 8 tokens); `options` are
    GRPOConfig's. The learning rate is large enough that a second iteration on the same batch is off-policy."""
    settings: dict[str, Any] = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=0.05,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    settings.update(options)
    args = GRPOConfig(output_dir=output_dir, **settings)
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    weights = os.path.join(output_dir, "model")
    if not os.path.isdir(weights):
        model().save_pretrained(weights)  # a path: with beta != 0 TRL loads its reference model from it
    return GRPOTrainer(
        model=weights, reward_funcs=reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer()
    )


def run(
    store: str,
    output_dir: str,
    *,
    before: Callable[[GRPOTrainer], None] | None = None,
    capture_options: dict[str, Any] | None = None,
    **options: Any,
) -> TrlCapture:
    """Train a tiny trainer with capture into `store` (by default from a writer thread; `capture_options` go to
    `enable_capture`), everything written when it returns. `before` may change the trainer first."""
    t = trainer(output_dir, **options)
    if before is not None:
        before(t)
    handle = enable_capture(t, store, **(capture_options or {"writer": "thread"}))
    t.train()
    assert handle.close(timeout=120)
    return handle
