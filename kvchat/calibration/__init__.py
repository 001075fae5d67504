"""Per-model measurements run once on calibration text (which layers retrieve, how a budget
is split, chelsea's thresholds), and the real queries, keys and values they are run on."""
