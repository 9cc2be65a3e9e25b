"""How far the patched and the stock transformers losses are from float64, and from each other, on a CPU.

    python tools/hf_loss_precision.py [--vocab 32000,262144] [--hidden 64] [--tokens 256] [--seed 0]

A tiny randomly initialised Llama (2 layers) in float32, its head scaled so that the logits spread like a trained
model's (standard deviation ~3, entropy a few nats rather than log V), one batch of random token ids. The same
weights are run three ways: the stock model (transformers' ForCausalLMLoss on float32 logits), the same model
patched with logitless.patch, and a float64 copy whose loss is computed from its float64 logits with
F.cross_entropy in float64 (transformers' own loss would call .float() on them and round them to float32 first).
For the loss and for every parameter's gradient it prints each float32 path's relative error against float64 and
their relative difference from each other. The numbers are in docs/hf.md.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run(vocab: int, hidden: int, tokens: int, seed: int) -> None:
    import transformers

    import logitless

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max(tokens, 128), tie_word_embeddings=False)
    stock = transformers.LlamaForCausalLM(cfg).float().train()
    ids = torch.randint(0, vocab, (2, tokens // 2))
    with torch.no_grad():
        spread = stock(input_ids=ids).logits.std()
        stock.lm_head.weight.mul_(3.0 / spread)
    patched = logitless.patch(copy.deepcopy(stock))
    exact = copy.deepcopy(stock).double()

    grads, losses = {}, {}
    for name, model in (("stock", stock), ("patched", patched)):
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses[name] = out.loss.detach()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    exact.zero_grad()
    logits = exact(input_ids=ids).logits                             # float64
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    losses["float64"] = loss.detach()
    grads["float64"] = {n: p.grad.clone() for n, p in exact.named_parameters()}
    lp = torch.log_softmax(logits.detach(), -1)
    entropy = -(lp.exp() * lp).sum(-1).mean().item()

    print(f"V={vocab} D={hidden} N={ids[:, 1:].numel()} tokens scored; float64 loss {losses['float64'].item():.6f}, "
          f"entropy {entropy:.2f} nats")
    for name in ("stock", "patched"):
        print(f"  loss {name:8s} |err| vs float64 {abs(losses[name].double() - losses['float64']).item():.2e}")
    print(f"  loss |stock - patched| {abs(losses['stock'] - losses['patched']).item():.2e}")
    worst = {"stock": 0.0, "patched": 0.0, "between": 0.0}
    for n in grads["float64"]:
        e_s = rel(grads["stock"][n], grads["float64"][n])
        e_p = rel(grads["patched"][n], grads["float64"][n])
        d = rel(grads["patched"][n], grads["stock"][n])
        worst["stock"], worst["patched"], worst["between"] = (max(worst["stock"], e_s),
                                                              max(worst["patched"], e_p), max(worst["between"], d))
        if n in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
            print(f"  grad {n:28s} rel err stock {e_s:.2e}  patched {e_p:.2e}  |stock - patched| {d:.2e}")
    print(f"  grad, worst parameter: rel err stock {worst['stock']:.2e}  patched {worst['patched']:.2e}  "
          f"|stock - patched| {worst['between']:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="32000,262144", help="vocabulary sizes, comma-separated")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for v in args.vocab.split(","):
        run(int(v), args.hidden, args.tokens, args.seed)


if __name__ == "__main__":
    main()
