"""strata.engine: load a pack by byte offset and generate text (``strata-engine generate``).

Flow, one module each:

- :mod:`~strata.engine.startup` - :func:`~strata.engine.startup.load_engine`, the one start-up sequence
  for every device (pack, weights, head, session, drafter, prompt path, expert cache, bind; docs/DESIGN.md
  "Start-up order"), over the types of :mod:`~strata.engine.core` (options, the loaded engine, what a
  device does) and the timed stages of :mod:`~strata.engine.checkpoints`;
- :mod:`~strata.engine.loader` - every tensor the forward pass reads asserted against geometry.txt
  (name, shape found, shape required) before a weight byte is read;
- :mod:`~strata.engine.dequant` - gguf-py's dequantizers, bit for bit (CPU reference path), and
  ggml's Q1_0 / Q2_0, which gguf-py lacks (:mod:`strata.packer.dequant_own`), chosen by each
  type's registry row (:mod:`strata.packer.quants`);
- :mod:`~strata.engine.weights` - the ``Weights`` interface (``get`` / ``matmul`` / ``rows``) and the
  NumPy store; :mod:`~strata.engine.experts` - routed experts from the shards, the resident set
  (``ExpertCache``) and the hit/miss split (``ExpertPath``);
- :mod:`~strata.engine.recipe` - the block-recipe vocabulary; :mod:`~strata.engine.models` - one recipe
  per architecture; :mod:`~strata.engine.decoder` - executes a recipe, one position per step, with
  NumPy or CuPy;
- :mod:`~strata.engine.layers` - shared layers over an array module ``xp`` (numpy or cupy), the KV
  cache (``--kv f16|f32``; sliding-window layers as ring buffers of the budget's size);
  :mod:`~strata.engine.deltanet` - the gated delta net and its recurrent state;
  :mod:`~strata.engine.numerics` - the numerics modes: f32 or llama.cpp's CPU activation roundings;
- :mod:`~strata.engine.tokenizer` - Hugging Face ``tokenizers`` built from the pack;
- :mod:`~strata.engine.generate` - the decode loop; :mod:`~strata.engine.measure` - the budget's plan
  beside what the engine allocated (``strata-engine measure``); :mod:`~strata.engine.routing` - the
  expert profile (``strata-engine profile``);
  :mod:`~strata.engine.cli` - the click commands. The GPU path lives in :mod:`strata.engine.gpu`.
"""
