"""What strata's engine allocates for a geometry: the byte layouts of its buffers, below both the
budget and the engine (the engine allocates with these functions, ``strata-budget`` plans with them).

The split rule: a function belongs here when it says how many bytes (or where inside an allocation)
strata's OWN engine puts something for a given geometry - its KV rings and recurrent state
(:mod:`.kv`), its decode step's device buffers and activation layouts (:mod:`.step`), its expert-cache
slots (:mod:`.experts`), a tensor's engine form (:mod:`.engine_form`), its per-stage arenas and
preallocated vectors (:mod:`.buffers`). The budget (:mod:`strata.budget`) keeps its rules: the cards,
the reserve, what the CUDA runtime and the driver take beyond the engine's buffers, the plan and the
expert-cache sizing and fill, and its models of OTHER engines (llama.cpp's cache cells, the reference
C++ engine's prompt buffers, the geometry model of activations).

Pure functions, bytes in and out; imports only :mod:`strata.manifests` and :mod:`strata.packer`
(tests/test_structure.py). Each name has one import path: its module here (no re-exports).
"""
