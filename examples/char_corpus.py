"""A deterministic English-like corpus from a small stochastic grammar.

Stories of a few paragraphs: each paragraph follows one named character whose
pronoun (he/she) must agree with the name many sentences later, quotes and
parentheses must close, and verbs agree with their subjects, so a character
model has short- and long-range structure to learn. Same (n_chars, seed) =>
same text on any platform (Python's `random.Random` is stable across versions
for `random()`, `choice` and `randint`).

    python examples/char_corpus.py 2000        # print the first 2000 characters
"""

from __future__ import annotations

import random
import sys

NAMES = {
    "she": ["Anna", "Mira", "Lena", "Rosa", "Ida", "Clara", "Nora", "Eva"],
    "he": ["Tom", "Owen", "Felix", "Hugo", "Max", "Leo", "Oscar", "Paul"],
}
ADJECTIVES = ["old", "small", "quiet", "bright", "tired", "clever", "red", "cold", "tall", "strange", "happy",
              "broken", "green", "heavy", "gentle"]
NOUNS = ["fox", "bird", "river", "house", "garden", "lamp", "boat", "tree", "letter", "window", "road", "horse",
         "bridge", "clock", "book", "field", "door", "hill", "cat", "stone"]
PLACES = ["the market", "the station", "the old mill", "the harbour", "the village", "the forest", "the school",
          "the bakery", "the lake", "the church"]
# (third person singular, past) of each verb taking an object.
VERBS = [("sees", "saw"), ("finds", "found"), ("carries", "carried"), ("paints", "painted"), ("opens", "opened"),
         ("follows", "followed"), ("builds", "built"), ("watches", "watched"), ("hides", "hid"),
         ("remembers", "remembered"), ("cleans", "cleaned"), ("sells", "sold")]
INTRANSITIVE = [("sleeps", "slept"), ("waits", "waited"), ("laughs", "laughed"), ("sings", "sang"),
                ("walks", "walked"), ("listens", "listened"), ("works", "worked")]
PREPOSITIONS = ["near", "behind", "under", "beside", "across", "above", "inside"]
TIMES = ["In the morning", "At night", "After the rain", "Every Sunday", "Later that day", "Before dawn",
         "On Monday", "In the winter", "At noon"]
ADVERBS = ["slowly", "quickly", "carefully", "quietly", "happily", "again", "twice"]
CONNECTIVES = ["because", "while", "although", "so", "and", "but"]
SAYINGS = ["we should go home", "the {noun} is {adj}", "I found the {noun}", "where is the {noun}",
           "it is too {adj} today", "look at that {adj} {noun}", "nobody saw the {noun}"]
NUMBER_WORDS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


class _Story:
  """One paragraph's state: the character and their pronoun."""

  def __init__(self, rng: random.Random):
    self.rng = rng
    self.pronoun = rng.choice(["she", "he"])
    self.name = rng.choice(NAMES[self.pronoun])
    self.possessive = "her" if self.pronoun == "she" else "his"

  def noun_phrase(self, depth: int = 0) -> str:
    r = self.rng
    det = r.choice(["the", "the", "a", self.possessive])
    adjs = " ".join(r.choice(ADJECTIVES) for _ in range(r.choice([0, 0, 1, 1, 2])))
    noun = r.choice(NOUNS)
    words = " ".join(w for w in (det, adjs, noun) if w)
    if words.startswith("a ") and words[2] in "aeiou":
      words = "an " + words[2:]
    if depth < 1 and r.random() < 0.25:
      words += f" {r.choice(PREPOSITIONS)} {self.noun_phrase(depth + 1)}"
    return words

  def subject(self, first: bool) -> str:
    if first or self.rng.random() < 0.3:
      return self.name
    return self.pronoun

  def clause(self, first: bool, past: bool) -> str:
    r = self.rng
    subj = self.subject(first)
    if r.random() < 0.7:
      verb = r.choice(VERBS)[past]
      text = f"{subj} {verb} {self.noun_phrase()}"
    else:
      verb = r.choice(INTRANSITIVE)[past]
      text = f"{subj} {verb}"
    if r.random() < 0.3:
      text += f" {r.choice(ADVERBS)}"
    if r.random() < 0.3:
      text += f" at {r.choice(PLACES)}"
    return text

  def saying(self) -> str:
    r = self.rng
    text = r.choice(SAYINGS).format(noun=r.choice(NOUNS), adj=r.choice(ADJECTIVES))
    return text[0].upper() + text[1:] + ("?" if text.startswith("where") else ",")

  def sentence(self, first: bool, past: bool) -> str:
    r = self.rng
    kind = r.random()
    if kind < 0.15 and not first:
      said = "said" if past else "says"
      return f'"{self.saying()}" {said} {self.subject(False)}.'
    if kind < 0.25:
      count = r.choice(NUMBER_WORDS)
      noun = r.choice(NOUNS)
      plural = noun + ("es" if noun.endswith(("x", "ch", "s")) else "s")
      has, is_ = ("had", "was") if past else ("has", "is")
      aside = f"{self.possessive} {noun} {is_} {r.choice(ADJECTIVES)}"
      return _capitalise(f"{self.subject(first)} {has} {count} {plural} ({aside}).")
    text = self.clause(first, past)
    if r.random() < 0.35:
      text += f" {r.choice(CONNECTIVES)} {self.clause(False, past)}"
    if r.random() < 0.3:
      text = f"{r.choice(TIMES)}, {text}"
    return _capitalise(text) + "."

  def paragraph(self) -> str:
    past = self.rng.random() < 0.5
    n = self.rng.randint(3, 7)
    return " ".join(self.sentence(i == 0, past) for i in range(n))


def _capitalise(text: str) -> str:
  return text[0].upper() + text[1:]


def generate(n_chars: int, seed: int = 0) -> str:
  """About n_chars characters (whole paragraphs, cut to exactly n_chars)."""
  rng = random.Random(seed)
  paragraphs: list[str] = []
  total = 0
  while total < n_chars:
    paragraph = _Story(rng).paragraph()
    paragraphs.append(paragraph)
    total += len(paragraph) + 2
  return "\n\n".join(paragraphs)[:n_chars]


if __name__ == "__main__":
  print(generate(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
