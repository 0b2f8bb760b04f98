"""A second graded task a small target is competent at: reading one field out of a short record.

Each question shows a made-up person's record (name, city, age, job, phone, e-mail, the year they joined; the
fields in a seeded order) and asks for one field; the answer is checked as the fact questions are
(:func:`specheads.facts.correct`: the first sentence names it as whole words). The records are generated from
the word lists below with a seeded generator, so every run reads the same questions; the ``kind`` of a
question is the field it asks for, and a split by kind (``specheads:extract:city+age``) keeps the fields one
half asks for out of the other (mine a judge on some, evaluate it on the others).

Prompt files: ``specheads:extract`` (every kind), ``specheads:extract:<kind>+<kind>`` (those kinds), read back
as source ``extract``; ``python -m specheads.facts.extract OUT.jsonl`` writes the rows out.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

NAME = "specheads:extract"
SEED = 0
PER_KIND = 60
FIRST = (
    "Maria Liam Aisha Kenji Olga Pedro Fatima Lars Chen Amara Tomas Ingrid Ravi Sofia Mateo Yara Dmitri Leila Noah "
    "Hana Kwame Elena Jonas Priya Omar Clara Felix Mei Andre Zainab Hugo Nadia Arjun Greta Diego Ayla Samuel Lucia"
).split()
LAST = (
    "Lopez Okafor Tanaka Novak Silva Haddad Berg Wang Mensah Kowalski Larsen Patel Rossi Garcia Nasser Petrov "
    "Karimi Cohen Sato Boateng Ivanova Fischer Sharma Costa Duval Lindqvist Moreau Kim Santos Abbasi Weber "
    "Horvat Reyes Yilmaz Dubois Nakamura Osei Brennan Vargas"
).split()
CITIES = (
    "Lisbon|Nairobi|Osaka|Prague|Lima|Beirut|Bergen|Chengdu|Accra|Krakow|Aarhus|Pune|Turin|Seville|Tabriz|Haifa|"
    "Sapporo|Kumasi|Kazan|Munich|Jaipur|Porto|Lyon|Uppsala|Nantes|Busan|Recife|Lahore|Graz|Zagreb|Cebu|Izmir|"
    "Quito|Hobart|Tunis|Leeds|Perth|Oslo|Cusco|Dakar"
).split("|")
JOBS = (
    "nurse|carpenter|pilot|teacher|baker|chemist|plumber|architect|librarian|farmer|dentist|journalist|"
    "electrician|tailor|surveyor|pharmacist|mechanic|florist|translator|geologist|butcher|cartographer|"
    "veterinarian|jeweler|beekeeper"
).split("|")
DOMAINS = ("example.com", "mail.test", "post.example", "inbox.test")
# the field each kind asks for: its label in the record and how the question names it
KINDS = {
    "city": ("City", "city"),
    "age": ("Age", "age"),
    "job": ("Job", "job"),
    "phone": ("Phone", "phone number"),
    "email": ("Email", "e-mail address"),
    "year": ("Joined", "year of joining"),
}


def _record(rng: random.Random) -> dict[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    return {
        "name": f"{first} {last}",
        "City": rng.choice(CITIES),
        "Age": str(rng.randint(19, 88)),
        "Job": rng.choice(JOBS),
        "Phone": f"{rng.randint(200, 989)}-{rng.randint(1000, 9999)}",
        "Email": f"{first.lower()}.{last.lower()}@{rng.choice(DOMAINS)}",
        "Joined": str(rng.randint(1961, 2023)),
    }


def rows(seed: int = SEED, per_kind: int = PER_KIND, kinds=None) -> list[dict]:
    """The questions, ``per_kind`` of each kind (of ``kinds``; default every kind), in a seeded order:
    ``{"id", "question", "answers", "kind", "source": "extract"}``."""
    wanted = list(KINDS) if kinds is None else list(kinds)
    unknown = [k for k in wanted if k not in KINDS]
    if unknown:
        raise ValueError(f"extract kinds {unknown}: choose from {list(KINDS)}")
    out = []
    for kind in KINDS:  # every kind drawn in a fixed order, so a subset's questions are the full set's
        rng = random.Random(f"{seed}-{kind}")
        label, spoken = KINDS[kind]
        for i in range(per_kind):
            rec = _record(rng)
            fields = [k for k in rec if k != "name"]
            rng.shuffle(fields)
            lines = [f"Name: {rec['name']}"] + [f"{k}: {rec[k]}" for k in fields]
            question = (
                "Here is a record.\n" + "\n".join(lines) + f"\n\nWhat is {rec['name']}'s {spoken}? "
                f"Answer with the {spoken} only."
            )
            if kind in wanted:
                out.append(
                    {"id": f"extract-{kind}-{i}", "question": question, "answers": [rec[label]], "kind": kind}
                    | {"source": "extract"}
                )
    random.Random(seed).shuffle(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m specheads.facts.extract OUT.jsonl [SEED]``: write the questions as a prompt file."""
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) > 2 or args[0].startswith("-"):
        print("usage: python -m specheads.facts.extract OUT.jsonl [SEED]", file=sys.stderr)
        return 2
    items = rows(int(args[1]) if len(args) > 1 else SEED)
    Path(args[0]).write_text("".join(json.dumps(r) + "\n" for r in items), encoding="utf-8")
    print(f"{len(items)} questions -> {args[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
