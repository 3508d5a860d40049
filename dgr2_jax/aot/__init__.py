"""Ahead-of-time compiling: the programs this project builds, compiled for the accelerators users
run (H100 / H200 GPUs, TPU slices) from any machine, and read.

  targets.py       named compile-only targets ('h100x8', 'h100x8x2', 'v5e-32', 'v5p-16', ...): their
                   devices (every host's), memory, peak FLOP/s and bandwidth; `compile_for(name)`,
                   inside which every route choice and mesh follows the target (dgr2_jax/platform.py)
  gpu_specs/       the GPU targets' descriptions (GpuTargetConfigProto text)
  hlo.py           the one reader of compiled programs: `compile_program` (memory, FLOPs and bytes,
                   loops and host round trips, collectives, custom calls, compile time) and the HLO
                   text parser everything else here builds on
  weight_reads.py  the weight bytes a decoding step reads, counted in a decoder's HLO
  programs.py      programs from shapes: the decoders at a model's shape, one decoding step
  compile_run.py   every program a run of a config executes (training steps, rollouts, eval's
                   decoders, the server), compiled for a target and set beside the dry run's plan:
                   `--config.dry_run=True --config.hardware.compile_for=TARGET`

  with targets.compile_for("h100x8"):
    mesh = train_mesh.make_mesh(config.train.mesh)      # over the 8 compile-only H100s
    prog = hlo.compile_program(jax.jit(step, in_shardings=...), *abstract_args, name="sft")
  print(prog.memory.peak, prog.collectives, prog.custom_calls)

Compiling for a target needs its compiler: `pip install -e ".[aot]"` (libtpu, the CUDA plugin).
The model and decode packages never import this one; it imports them (compile_run.py: the stages,
training and serving too), so it sits beside `main`, above every other package.
"""
