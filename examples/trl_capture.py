"""Capture a TRL GRPOTrainer with one line, then replay one of its steps. CPU, offline, a few seconds.

    python examples/trl_capture.py [STORE]          # STORE: a path or URL (default: a temporary directory)

A random-weight Qwen2 (hidden 32, 2 layers) built from a config, a character-level tokenizer built with
`tokenizers`, 8 prompts and a Python reward: two optimizer steps of TRL's defaults (loss_type dapo), each
generation batch used for two iterations. Needs the `[trl]` extra.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trajectory_replay.bundle.resolve import open_for_replay  # noqa: E402
from trajectory_replay.integrations.trl import enable_capture  # noqa: E402
from trajectory_replay.replay import replay  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz "


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, with a pad and an end-of-sequence token."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def model(seed: int = 0) -> Qwen2ForCausalLM:
    """A random-weight Qwen2 of hidden size 32 and 2 layers over `tokenizer()`'s vocabulary."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(CHARS) + 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)


def reward(completions: list[str], **kwargs: object) -> list[float]:
    """More 'a's and longer answers score higher."""
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


def main(store: str) -> int:
    work = tempfile.mkdtemp(prefix="trl-capture-")
    args = GRPOConfig(
        output_dir=work,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        num_iterations=2,
        learning_rate=0.05,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]})
    trainer = GRPOTrainer(
        model=model(), reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer()
    )
    capture = enable_capture(trainer, store)  # the one line
    trainer.train()
    capture.close(timeout=60)

    sources, _ = open_for_replay(store, step="0:1")  # the second iteration on generation batch 0
    report = replay(sources)
    for stage in report.stages:
        print(f"{stage.stage}: {stage.status} ({stage.message})")
    print(f"captured into {store}; replay it with: trajectory-replay replay {store} --step 0:1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="trl-store-")))
