"""The benchmark sweep behind tools/benchmark.py and tools/convergence.py.

configs  what one measured run is (BenchRun) and the sweeps (paper, smoke, grid)
runner   runs each BenchRun in a fresh subprocess (tools/bench/worker.py) under a progress bar
worker   one run in this process: our loop, Keras model.fit, or PyTorch DDP (torch_peer.py)
report   speedup, efficiency, peer ratios; CSV, JSON and Markdown tables
plots    PNG plots (matplotlib, the `bench` extra)
convergence  test error against wall-clock time for each configuration (the paper's Figure 1)
sweep    one sweep from its settings: the runs, then the tables, JSON, CSV and plots
torch_models, torch_peer  the PyTorch twins of our models and the DDP peer that runs them
replica_consistency  what replica-independent Dropout and synchronised BatchNorm cost (a tool)
"""
