"""The bench's local multiple-choice task, built in memory from text every Debian/Ubuntu machine has (nothing
downloaded, nothing cached): `custom_dataset: !function data.license_choice` in license_choice.yaml.

modcli_license_choice: which sentence comes next? Each item is two consecutive sentences of a license text in
/usr/share/common-licenses (prose the bench never trains on) and four endings: the sentence that follows them and
three sentences of similar length drawn from the other licenses. Deterministic (seeded), 200 items; a model that
follows the text picks the true next sentence, chance is 25%. Licenses that share wording (GPL/LGPL versions) are
kept apart: a distractor never occurs in the item's own license, so it cannot be the right answer in disguise.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

import datasets

LICENSES = Path("/usr/share/common-licenses")
ITEMS = 200
SEED = 1337
MIN_CHARS, MAX_CHARS = 40, 200


def _sentences(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.;!?])\s+(?=[A-Z(\"])", text) if s.strip()]


def _texts(root: Path) -> dict[str, str]:
    """Each distinct license text once (GPL is a link to GPL-3, and so on), by file name."""
    seen: set[str] = set()
    texts: dict[str, str] = {}
    for path in sorted(root.iterdir()):
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            texts[path.name] = text
    return texts


def build_items(root: Path = LICENSES, items: int = ITEMS, seed: int = SEED) -> list[dict]:
    texts = _texts(root)
    if len(texts) < 2:
        raise FileNotFoundError(f"{root}: the license choice task needs at least two license texts there")
    sentences = {name: _sentences(text) for name, text in texts.items()}
    usable = [(name, j) for name, sents in sentences.items() for j in range(2, len(sents))
              if MIN_CHARS <= len(sents[j]) <= MAX_CHARS and all(len(s) <= 2 * MAX_CHARS for s in sents[j - 2:j])]
    rng = random.Random(seed)
    rng.shuffle(usable)
    rows = []
    for name, j in usable:
        if len(rows) == items:
            break
        answer = sentences[name][j]
        own = re.sub(r"\s+", " ", texts[name])
        pool = [s for other, sents in sentences.items() if other != name for s in sents
                if abs(len(s) - len(answer)) <= max(10, len(answer) // 4) and s not in own]
        if len(pool) < 3:
            continue
        choices = [answer, *rng.sample(sorted(set(pool)), 3)]
        rng.shuffle(choices)
        rows.append({"context": " ".join(sentences[name][j - 2:j]), "choices": choices,
                     "answer": choices.index(answer), "license": name})
    return rows


def license_choice(**metadata) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(build_items())})
