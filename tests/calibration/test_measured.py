"""The embedded model's measurements ship with kvchat (kvchat/calibration/measured/): a fresh data home
reads them instead of measuring, and they stay those of the current measurement code."""

from __future__ import annotations

import json

import pytest

from kvchat.calibration import calibrate
from kvchat.paths import models_dir

MEASUREMENTS = {  # file -> (version, key holding one entry per layer); chelsea's has no version
    calibrate.measurement_path: (calibrate.MEASUREMENT_VERSION, "curves"),
    calibrate.retrieval_path: (calibrate.RETRIEVAL_VERSION, "masses"),
}


@pytest.mark.parametrize("configuration", ["embedded", "embedded_fast"])
def test_kvchat_ships_every_measurement_of_both_cpu_configurations_at_the_current_version(configuration, request):
    loaded = request.getfixturevalue(configuration)
    for path_of, (version, key) in MEASUREMENTS.items():
        shipped = json.loads((calibrate.SHIPPED / path_of(loaded.fingerprint).name).read_text())
        assert shipped["version"] == version
        assert len(shipped[key]) == loaded.num_layers
    chelsea = json.loads(
        (calibrate.SHIPPED / calibrate.calibration_path("chelsea", loaded.fingerprint).name).read_text()
    )
    assert sorted(chelsea["layers"], key=int) == [str(i) for i in range(loaded.num_layers)]


def test_a_fresh_data_home_reads_the_shipped_measurements_and_measures_nothing(embedded_fast, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    shipped = json.loads((calibrate.SHIPPED / calibrate.retrieval_path(embedded_fast.fingerprint).name).read_text())
    assert calibrate.recall_layers(embedded_fast) == calibrate.choose_recall_layers(shipped["masses"])
    assert len(calibrate.layer_weights(embedded_fast)) == embedded_fast.num_layers
    assert not models_dir().exists()  # a measurement would have been written there


def test_another_model_is_measured_not_given_the_embedded_models_files(tiny_model_dir, tmp_path, monkeypatch):
    from kvchat.model.loading import load_model

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    tiny = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    weights = calibrate.layer_weights(tiny)
    assert len(weights) == tiny.num_layers == 2
    assert calibrate.measurement_path(tiny.fingerprint).is_file()  # measured and cached in the models folder
