"""Loss-curve comparison shared by the FP8 curve scripts: runs write metrics.jsonl under
OUT/<name>/, and two runs are compared by their mean loss over each 10 iterations (the FP8
curve test's measure)."""
import glob
import json
import os


def means(out, name):
    """10-iteration mean losses of run `name` under `out`; [] when it wrote none."""
    files = glob.glob(os.path.join(out, name, "**", "metrics.jsonl"), recursive=True)
    if not files:
        return []
    with open(files[0]) as f:
        loss = [json.loads(l)["lm_loss"] for l in f if l.strip() and "lm_loss" in l]
    return [sum(loss[i:i + 10]) / 10 for i in range(0, len(loss) - 9, 10)]


def difference(curve, base):
    """'worst +x% at N, final +y%' of curve relative to base, or None if they differ in length."""
    if not base or len(curve) != len(base):
        return None
    d = [(x - y) / y for x, y in zip(curve, base)]
    k = max(range(len(d)), key=lambda i: abs(d[i]))
    return f"worst {100 * d[k]:+.2f}% at {10 * (k + 1)}, final {100 * d[-1]:+.2f}%"
