"""zerodp's benchmarks and their results (a package only so that `python -m bench.harness` runs from the checkout)."""
