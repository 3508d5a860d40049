"""Qwen3 in Flax (`qwen3`), its config (`config`), attention masks (`masks`) and checkpoint IO."""
