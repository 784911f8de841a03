"""PNG plots of a sweep (matplotlib, from the `bench` extra; the Agg backend needs no display).

speedup.png      speedup over one device for each configuration (the paper's speedups beside)
throughput.png   images/s against the global batch, one line per configuration (RQ4)
memory.png       bytes per device by strategy, split into parameters, gradients, optimizer
                 slots and activations (RQ5)
One panel per model (and data set / image size); ours only, the peers are in the tables.
"""

from __future__ import annotations

import os

from tools.bench.configs import PAPER_SPEEDUP

MEMORY_PARTS = ("parameters", "gradients", "optimizer_slots", "activations")


def write_plots(rows, out_dir) -> list[str]:
    """Writes the PNGs that the rows allow; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    ours = [r for r in rows if r["kind"] == "ours" and not r.get("error")]
    if not ours:
        return []
    paths = [os.path.join(out_dir, name) for name in ("speedup.png", "throughput.png", "memory.png")]
    _speedup(ours, paths[0])
    _throughput(ours, paths[1])
    _memory(ours, paths[2])
    return paths


def _panels(rows):
    """A figure with one panel per (model, data set, image size): (fig, [(ax, key, rows)])."""
    keys = []
    for r in rows:
        key = (r["model"], r["dataset"], r["image_size"])
        if key not in keys:
            keys.append(key)
    fig, axes = _figure(len(keys))
    return fig, [(ax, key, [r for r in rows if (r["model"], r["dataset"], r["image_size"]) == key])
                 for ax, key in zip(axes, keys)]


def _title(key):
    model, dataset, size = key
    return f"{model}, {dataset}" + (f" {size}x{size}" if size else "")


def _figure(n):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)
    return fig, axes[0]


def _save(fig, path):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _configs(rows):
    """(strategy, devices, label) in sweep order."""
    seen = []
    for r in rows:
        item = (r["strategy"], r["devices"], r["label"])
        if item not in seen:
            seen.append(item)
    return seen


def _speedup(rows, path):
    fig, panels = _panels(rows)
    for ax, key, panel in panels:
        configs = _configs(panel)
        batches = sorted({r["global_batch"] for r in panel})
        width = 0.8 / (len(batches) + 1)
        for j, batch in enumerate(batches):
            values = [next((r.get("speedup") or 0 for r in panel if (r["strategy"], r["devices"], r["global_batch"])
                            == (s, n, batch)), 0) for s, n, _ in configs]
            ax.bar([i + j * width for i in range(len(configs))], values, width, label=f"batch {batch}")
        paper = [PAPER_SPEEDUP.get((s, n), 0) for s, n, _ in configs]
        if any(paper):
            ax.bar([i + len(batches) * width for i in range(len(configs))], paper, width, color="lightgrey",
                   hatch="//", label="paper (GPUs, batch 256)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * len(batches) / 2 for i in range(len(configs))])
        ax.set_xticklabels([label for *_, label in configs], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("speedup over one device")
        ax.set_title(_title(key))
        ax.legend(fontsize=8)
    _save(fig, path)


def _throughput(rows, path):
    fig, panels = _panels(rows)
    for ax, key, panel in panels:
        for s, n, label in _configs(panel):
            points = sorted((r["global_batch"], r["images_per_s_median"], r["images_per_s_p10"], r["images_per_s_p90"])
                            for r in panel if (r["strategy"], r["devices"]) == (s, n))
            xs, ys, lo, hi = zip(*points)
            ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]],
                        marker="o", capsize=3, label=label)
        batches = sorted({r["global_batch"] for r in panel})
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("global batch")
        ax.set_ylabel("images/s (median, p10-p90)")
        ax.set_title(_title(key))
        ax.legend(fontsize=8)
    _save(fig, path)


def _memory(rows, path):
    fig, panels = _panels(rows)
    for ax, key, panel in panels:
        panel = [r for r in panel if r.get("memory_total_bytes") is not None]
        batch = max(r["global_batch"] for r in panel) if panel else None
        panel = [r for r in panel if r["global_batch"] == batch]
        labels = [r["label"] for r in panel]
        bottom = [0.0] * len(panel)
        for part in MEMORY_PARTS:
            values = [(r.get(f"memory_{part}_bytes") or 0) / 2**20 for r in panel]
            ax.bar(range(len(panel)), values, bottom=bottom, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(panel)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("MiB per device")
        ax.set_title(f"{_title(key)}, global batch {batch}")
        ax.legend(fontsize=8)
    _save(fig, path)
