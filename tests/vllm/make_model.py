"""Build a tiny Llama with random, fixed-seed weights in a local directory (no hub).

Run inside the vLLM venv: ``python make_model.py OUT_DIR[@SEED] ... [--layers L]
[--hidden H] [--heads A] [--kv-heads K] [--vocab V]`` (one process builds them all:
the imports are most of the time). Weights are redrawn from
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
    args = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for out in args.outs:
        path, _, seed = out.partition("@")
        build(torch, LlamaConfig, LlamaForCausalLM, args, path, int(seed or 0))
        print(path)


def build(torch, config_cls, model_cls, args, out: str, seed: int) -> None:
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate or 2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.max_pos, torch_dtype="float32",
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = model_cls(cfg)
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
