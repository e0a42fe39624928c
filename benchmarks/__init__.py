"""How the project measures itself: benchmarks against peers (HF transformers, llama.cpp's server), studies
and their reports (benchmarks/reports/). Not installed with motet; run from the repository root as
`python -m benchmarks.NAME`. What users run is `motet eval` (motet/evals/)."""
