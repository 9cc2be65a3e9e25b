"""GRPO with TRL, its log-probs from logitless: a tiny model built here, a toy reward, no download, CPU-friendly.

    python examples/rl_grpo.py                # patched: TRL's per-token log-probs through linear_log_probs
    python examples/rl_grpo.py --stock        # the same run with TRL's own fused head, for comparison
    python examples/rl_grpo.py --steps 20 --vocab 32000

The model is a 2-layer Llama with random weights and a character tokenizer (the first ids are characters, the rest
of the vocabulary is never produced by the tokenizer but is in the softmax, as in a real model's head). The reward
prefers completions of the tokenizer's characters, vowels most. Needs ``pip install trl`` (the ``[trl]`` extra).
"""

from __future__ import annotations

import argparse
import string
import tempfile

import torch
import transformers
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from trl import GRPOConfig, GRPOTrainer

import logitless.integrations.trl as logitless_trl


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    chars = string.ascii_lowercase + string.digits + " .,!?"
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                                eos_token="<eos>", padding_side="left")


def vowel_reward(completions, completion_ids, **kwargs) -> list[float]:
    """Tokens that are vowels score 1, other characters 0.2, ids outside the tokenizer's alphabet 0."""
    alphabet = tokenizer().get_vocab()
    vowels = {alphabet[c] for c in "aeiou"}
    return [sum(1.0 if i in vowels else 0.2 if i < len(alphabet) else 0.0 for i in ids) / max(len(ids), 1)
            for ids in completion_ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stock", action="store_true", help="do not patch: TRL's own fused head")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size of the model's head")
    p.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    args = p.parse_args()

    torch.manual_seed(0)
    tok = tokenizer()
    config = transformers.LlamaConfig(vocab_size=max(args.vocab, len(tok)), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        model.save_pretrained(f"{out}/init")  # GRPO builds its reference model from the policy's path
        model.config._name_or_path = f"{out}/init"
        prompts = ["the cat", "a dog", "hello", "why is", "one two", "ok so", "i think", "we can"]
        training = GRPOConfig(
            output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
            max_steps=args.steps, num_iterations=2, beta=0.04, temperature=0.9, learning_rate=3e-3,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
            bf16=False, seed=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=vowel_reward, args=training,
                              train_dataset=Dataset.from_dict({"prompt": prompts * 4}), processing_class=tok)
        if not args.stock:
            logitless_trl.patch(trainer)  # the one call: policy and reference model, loss and no-grad passes
        trainer.train()
        if not args.stock:
            logitless_trl.unpatch(trainer)
    for row in trainer.state.log_history:
        if "loss" in row:
            reward = float(row.get("reward", "nan"))  # logged at the steps that generate
            print(f"step {row['step']:3d}  loss {float(row['loss']):+.5f}  reward {reward:.4f}  "
                  f"entropy {float(row['entropy']):.4f}")


if __name__ == "__main__":
    main()
