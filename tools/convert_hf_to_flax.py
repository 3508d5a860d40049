r"""Converts a Qwen3 checkpoint between an HF directory and ours (Orbax params + config.json).

  python tools/convert_hf_to_flax.py --hf_dir=Qwen3-0.6B --flax_dir=ckpt/qwen3_0p6b \
      --add_tokens=workdir/sids/tokens.txt --mask_token='<|mask|>' --block_size=4
  python tools/convert_hf_to_flax.py --reverse --flax_dir=ckpt/qwen3_0p6b --hf_dir=out/hf

Forward reads `config.json` + `model.safetensors` (or shards + index), writes the Orbax checkpoint,
the model config and the tokenizer files. `--add_tokens`/`--mask_token` extend the tokenizer and the
embedding/LM-head rows (new rows = mean of the existing ones). `--reverse` writes a directory that
`transformers.AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load, sharded above
`--shard_bytes`. Errors are one line; nothing partial is ever written.
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dgr2_jax.model import checkpoint  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "HF checkpoint directory (input; output with --reverse).")
flags.DEFINE_string("flax_dir", None, "Our checkpoint directory (output; input with --reverse).")
flags.DEFINE_bool("reverse", False, "Convert ours -> HF instead of HF -> ours.")
flags.DEFINE_bool("overwrite", False, "Replace the output directory if it exists.")
flags.DEFINE_string("add_tokens", None, "File of tokens to add to the tokenizer, one a line.")
flags.DEFINE_string("mask_token", None, "Mask token to add as the tokenizer's mask_token, e.g. <|mask|>.")
flags.DEFINE_integer("block_size", 1, "Block-diffusion block size recorded in the config.")
flags.DEFINE_enum("attention", None, ["causal", "block_causal"],
                  "Attention kind; default: block_causal when --block_size > 1, else causal.")
flags.DEFINE_string("dtype", None, "Cast parameters to this dtype (float32|bfloat16|float16); "
                    "default keeps the checkpoint's.")
flags.DEFINE_integer("shard_bytes", checkpoint.DEFAULT_SHARD_BYTES,
                     "--reverse: shard model.safetensors above this many bytes.")
flags.mark_flags_as_required(["hf_dir", "flax_dir"])


def main(argv):
  del argv
  try:
    if FLAGS.reverse:
      if FLAGS.add_tokens or FLAGS.mask_token or FLAGS.dtype:
        raise ValueError("--add_tokens/--mask_token/--dtype apply to the forward conversion only")
      config = checkpoint.convert_ours_to_hf(FLAGS.flax_dir, FLAGS.hf_dir,
                                             shard_bytes=FLAGS.shard_bytes, overwrite=FLAGS.overwrite)
      out = FLAGS.hf_dir
    else:
      config = checkpoint.convert_hf_to_ours(
          FLAGS.hf_dir, FLAGS.flax_dir, add_tokens_file=FLAGS.add_tokens,
          mask_token=FLAGS.mask_token, block_size=FLAGS.block_size, attention=FLAGS.attention,
          dtype=FLAGS.dtype, overwrite=FLAGS.overwrite)
      out = FLAGS.flax_dir
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    sys.exit("error: " + " ".join(str(e).split("\n")))
  print(f"wrote {out}: vocab_size={config.vocab_size} param_dtype={config.param_dtype} "
        f"mask_token_id={config.mask_token_id} block_size={config.block_size} "
        f"attention={config.attention}")


if __name__ == "__main__":
  app.run(main)
