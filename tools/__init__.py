"""Command-line tools that sit beside the package: benchmarks and the convergence comparison."""
