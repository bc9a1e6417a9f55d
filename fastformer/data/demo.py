"""The embedded demo set: short English movie reviews with sentiment labels, generated here.

It is not real data. Each review is built from a small grammar of clauses about aspects of a film
("the plot was really gripping", "the acting was not bad", "I regretted watching it"); each clause
carries a polarity, negation flips it, and in a contrast ("..., but overall ...") the overall
clause decides. The label is 1 (positive) or 0 (negative). A model has to read word order and
negation to get it right, so it is a fair smoke test of the whole training job, but the accuracy
reached on it says nothing about accuracy on real reviews such as NSMC.

Regenerate the shipped files (they are deterministic) with

    python -m fastformer.data.demo
"""

import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_FILE = os.path.join(HERE, "demo_train.tsv")
TEST_FILE = os.path.join(HERE, "demo_test.tsv")
N_TRAIN, N_TEST, SEED = 4000, 1000, 2026

ASPECTS = [
    "the acting",
    "the plot",
    "the soundtrack",
    "the dialogue",
    "the ending",
    "the cinematography",
    "the cast",
    "the script",
    "the pacing",
    "the direction",
    "the special effects",
    "the story",
    "the lead actor",
    "the villain",
    "the humour",
    "the first half",
    "the final act",
    "the score",
]
POSITIVE = [
    "great",
    "wonderful",
    "moving",
    "brilliant",
    "charming",
    "gripping",
    "superb",
    "delightful",
    "clever",
    "beautiful",
    "funny",
    "heartfelt",
    "stunning",
    "memorable",
    "excellent",
    "fresh",
]
NEGATIVE = [
    "boring",
    "awful",
    "dull",
    "clumsy",
    "predictable",
    "tedious",
    "weak",
    "terrible",
    "lifeless",
    "confusing",
    "forgettable",
    "painful",
    "messy",
    "shallow",
    "bland",
    "bad",
]
INTENSIFIERS = ["", "", "really ", "truly ", "quite ", "so ", "absolutely ", "rather "]
VERDICTS = {
    1: [
        "I loved this movie",
        "I enjoyed every minute",
        "I would watch it again",
        "two thumbs up",
        "highly recommended",
        "one of the best films this year",
        "I left the cinema smiling",
    ],
    0: [
        "I hated this movie",
        "I regretted watching it",
        "a waste of two hours",
        "skip it",
        "not recommended",
        "one of the worst films this year",
        "I almost walked out",
    ],
}
OVERALL = {
    1: ["overall I liked it", "it is still worth seeing", "the rest makes up for it"],
    0: ["overall I disliked it", "it is not worth seeing", "nothing else saves it"],
}


def _clause(rng, polarity):
    """One clause whose meaning has the given polarity (1 positive, 0 negative)."""
    aspect = rng.choice(ASPECTS)
    if rng.random() < 0.25:  # negation: "not <opposite adjective>"
        adjective = rng.choice(NEGATIVE if polarity else POSITIVE)
        return f"{aspect} was not {adjective}"
    adjective = rng.choice(POSITIVE if polarity else NEGATIVE)
    return f"{aspect} was {rng.choice(INTENSIFIERS)}{adjective}"


def review(rng, label):
    """One review text with the given label."""
    if rng.random() < 0.3:  # a contrast: a clause against the label, then the overall verdict
        text = f"{_clause(rng, 1 - label)}, but {rng.choice(OVERALL[label])}"
    else:
        clauses = [_clause(rng, label) for _ in range(rng.randint(1, 3))]
        if len(clauses) > 1 and rng.random() < 0.5:
            clauses[-1] = "and " + clauses[-1]
        text = ", ".join(clauses)
    if rng.random() < 0.5:
        verdict = rng.choice(VERDICTS[label])
        text = f"{text}. {verdict[0].upper()}{verdict[1:]}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", "!", "..."])


def generate(n_train=N_TRAIN, n_test=N_TEST, seed=SEED):
    """(train, test) lists of (id, document, label), balanced labels, no test text seen in train."""
    rng = random.Random(seed)
    train, test, seen = [], [], set()
    next_id = 1000001
    while len(train) < n_train or len(test) < n_test:
        split = train if len(train) < n_train else test
        label = len(split) % 2  # alternate labels: balanced classes
        text = review(rng, label)
        if split is test and text in seen:
            continue
        seen.add(text)
        split.append((next_id, text, label))
        next_id += 1
    return train, test


def write_tsv(rows, path):
    """Write NSMC's format: a header `id<TAB>document<TAB>label`, then one review per line."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("id\tdocument\tlabel\n")
        for id_, text, label in rows:
            f.write(f"{id_}\t{text}\t{label}\n")


def main():
    train, test = generate()
    write_tsv(train, TRAIN_FILE)
    write_tsv(test, TEST_FILE)
    print(f"wrote {len(train)} reviews to {TRAIN_FILE} and {len(test)} to {TEST_FILE}")


if __name__ == "__main__":
    main()
