"""The embedded model's per-model measurements, shipped so that it never waits for them.

Each JSON file here is what `kvchat.calibration.calibrate` caches in a fresh models folder for the
embedded SmolLM2-135M-Instruct on the CPU, in both of its CPU configurations
(`--dtype float32`, and int8 weights with bf16 compute, the default): chelsea's
calibration, the layer allocation of byte budgets, and the layers that recall. The
names carry the model's fingerprint (its file's digest, the dtype and the quantisation),
so another model or configuration never reads them; `kvchat.calibration.calibrate.saved` reads a file
here when the models folder has none of that name.

`python -m kvchat.calibration.measured` measures them again in a temporary data home (run it after
changing a measurement, and commit the files it writes).
"""
