"""Write src/verispec/data/code_edit.jsonl: code-editing requests built from the bundled HumanEval prompts.

Editing code is where a speculative decoder meets its easiest text and its users' most common request
("rename this", "add a comment", "implement the body"): the answer repeats most of the prompt, which
prompt lookup and suffix decoding draft from. Each row pairs one bundled HumanEval prompt (MIT; the text
unchanged) with one of five edits, in Spec-Bench's row form, so `verispec bench code_edit` sends it
through the model's chat template. Deterministic: rerunning this writes the same file.

    python bench/make_code_edit.py
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "src" / "verispec" / "data"

EDITS = [
    "Rename the function to `solve` and keep everything else exactly as it is",
    "Add the comment line `# TODO: implement` right after the docstring and keep everything else exactly as it is",
    "Add `from __future__ import annotations` as the first line and keep everything else exactly as it is",
    "Replace every `\"\"\"` with `'''` and keep everything else exactly as it is",
    "Implement the function below its docstring",
]


def main() -> None:
    rows = [json.loads(line) for line in (DATA / "humaneval.jsonl").read_text().splitlines() if line.strip()]
    with (DATA / "code_edit.jsonl").open("w") as out:
        for i, row in enumerate(rows):
            edit = EDITS[i % len(EDITS)]
            turn = (f"{edit}. Reply with the complete updated code in one Python code block and nothing else.\n\n"
                    f"```python\n{row['prompt']}```")
            out.write(json.dumps({"question_id": f"edit/{row['task_id']}", "category": "code_edit", "turns": [turn]}) + "\n")
    print(f"wrote {len(rows)} rows to {DATA / 'code_edit.jsonl'}")


if __name__ == "__main__":
    main()
