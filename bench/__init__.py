"""Measurements: bench.py against transformers, vLLM and TRL; the comparison with baselines
(compare.sh, report.py); the off-policy lab. Run with python -m bench.NAME."""
