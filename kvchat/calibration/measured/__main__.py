"""Measure the embedded model again and write its measurements into this folder."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGURATIONS = ("float32", "int8")


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="kvchat-measure-"))
    converted_from = None
    if os.environ.get("KVCHAT_HOME"):  # reuse the converted GGUF copy rather than convert again
        converted_from = Path(os.environ["KVCHAT_HOME"]) / "models"
    os.environ["KVCHAT_HOME"] = str(home)

    from kvchat import compress
    from kvchat.calibration import calibrate
    from kvchat.model.loading import load_model
    from kvchat.paths import models_dir

    calibrate.SHIPPED = None  # measure, do not read what this folder holds
    models_dir().mkdir(parents=True)
    if converted_from is not None:
        for folder in converted_from.glob("*-*"):
            if folder.is_dir():
                (models_dir() / folder.name).symlink_to(folder)
    written = []
    for dtype in CONFIGURATIONS:
        loaded = load_model(device="cpu", dtype=dtype)
        for method in [compress.get(name) for name in compress.available()]:
            if hasattr(method, "calibrate"):
                written.append(calibrate.calibration_path(method.name, loaded.fingerprint))
                started = time.perf_counter()
                calibrate.calibrated_layer_params(loaded, method)
                print(f"{dtype}: {method.name} calibration {time.perf_counter() - started:.1f} s")
        for what, path_for in (
            ("layer_weights", calibrate.measurement_path),
            ("recall_layers", calibrate.retrieval_path),
        ):
            started = time.perf_counter()
            getattr(calibrate, what)(loaded)
            written.append(path_for(loaded.fingerprint))
            print(f"{dtype}: {what} {time.perf_counter() - started:.1f} s")
    for old in HERE.glob("*.json"):
        old.unlink()
    for path in written:
        shutil.copyfile(path, HERE / path.name)
        print("wrote", HERE / path.name)
    shutil.rmtree(home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
