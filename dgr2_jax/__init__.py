"""dgr2_jax: Diffusion-GR2 (block-diffusion generative reasoning re-ranker) in JAX/Flax."""

__version__ = "0.1.0"
