"""Refine a synthetic bank problem from Python and print the result table.

Run from the repository root:  python examples/python/refine_bank_problem.py
"""

from pathlib import Path

from refine import make_problem, refine, save_json

problem = make_problem("cubic_mosflm", size=32)        # a 32 x 32 still with a known truth
result = refine(problem)                               # default stages (Stage-A), LBFGS, esds
print(result.summary())
print("fit excess:", round(result.fit["excess"], 3))
for name in ("cell_a",):
    print(f"{name}: refined {result.params[name]:.4f}, truth {problem.truth[name]:.4f}, "
          f"esd {result.esds[name]:.2g} A")
Path("out/python_example").mkdir(parents=True, exist_ok=True)
save_json(result, "out/python_example/result.json")
