"""Build a tiny Llama (or Gemma-3) with random, fixed-seed weights in a local directory
(no hub).

Run inside the vLLM venv: ``python make_model.py OUT_DIR[@SEED] ... [--layers L]
[--hidden H] [--heads A] [--kv-heads K] [--vocab V] [--arch gemma3 --sliding-window W]``
(one process builds them all: the imports are most of the time). ``--arch gemma3``: a
text-only Gemma-3 whose layers alternate sliding-window and full attention
(``layer_types``; the first is sliding), head size 64: a hybrid model, two KV cache
groups in vLLM. Weights are redrawn from
N(0, 0.05) so that greedy decoding is not degenerate (the default init gives the
same token over and over). fp32, safetensors. Prints the directory.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outs", nargs="+", help="DIR or DIR@SEED (default seed 0)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--arch", choices=("llama", "gemma3"), default="llama")
    ap.add_argument("--sliding-window", type=int, default=64)
    args = ap.parse_args()
    import torch

    for out in args.outs:
        path, _, seed = out.partition("@")
        build(torch, args, path, int(seed or 0))
        print(path)


def build(torch, args, out: str, seed: int) -> None:
    torch.manual_seed(seed)
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=args.intermediate or 2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads,
                  max_position_embeddings=args.max_pos, torch_dtype="float32",
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if args.arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        kinds = ["sliding_attention", "full_attention"]
        cfg = Gemma3TextConfig(**common, head_dim=64, sliding_window=args.sliding_window,
                               layer_types=[kinds[i % 2] for i in range(args.layers)],
                               pad_token_id=0)
        model = Gemma3ForCausalLM(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "ems-model.json"), "w") as f:
        json.dump(dict(vars(args), outs=None, seed=seed), f)


if __name__ == "__main__":
    main()
