"""Chat-style training prompts for draft distillation, built from templates × topics.

No data set can be downloaded here, so prompts are composed: every template is paired with topics
of its kind, giving thousands of distinct requests across the four kinds the held-out set mixes
(chat, story, code, factual). The held-out prompts (`assets/prompts.json`) are excluded by
construction and by a test.
"""

from __future__ import annotations

import random

from engine.prompts import held_out_prompts

FACTUAL_TOPICS = [
    "volcanoes", "the water cycle", "black holes", "the Roman Empire", "vaccines", "earthquakes",
    "the human heart", "electricity", "the moon landing", "coral reefs", "the printing press",
    "climate change", "DNA", "the Great Wall of China", "honey bees", "rainbows", "tides",
    "the immune system", "the Industrial Revolution", "plate tectonics", "the solar system",
    "ancient Egypt", "the internet", "magnets", "the Renaissance", "glaciers", "sound waves",
    "the stock market", "inflation", "democracy", "the Amazon rainforest", "antibiotics",
    "the speed of light", "the periodic table", "the Cold War", "deserts", "hurricanes",
    "the Olympic Games", "gravity", "bacteria", "the brain", "solar panels", "nuclear energy",
    "the Silk Road", "dinosaurs", "the Moon's phases", "recycling", "the ozone layer",
    "the Eiffel Tower", "the Byzantine Empire", "penguins", "whales", "sleep", "caffeine",
    "the metric system", "batteries", "airplanes", "the compass", "the Milky Way", "fungi",
]
STORY_TOPICS = [
    "a robot who learns to paint", "a girl who can talk to birds", "a haunted library",
    "a detective cat", "a time traveller stuck in 1850", "a village under the sea",
    "an old clockmaker", "a friendly ghost", "a lost astronaut", "a pirate who hates water",
    "a wizard's apprentice", "a talking tree", "a city in the clouds", "two rival bakers",
    "a dog who runs for mayor", "a secret door in a school", "the last snowflake of winter",
    "a knight who is afraid of horses", "a musician on a desert island", "an android gardener",
    "a fox and a crow", "a midnight carnival", "a map that changes every night", "a tiny giant",
    "a shy volcano", "a boy who collects storms", "an inventor's broken machine", "a lonely moon",
    "a mountain rescue", "a mysterious package", "a train that never stops", "a kingdom of cats",
]
CODE_TOPICS = [
    "reverses a list", "counts the vowels in a string", "computes the factorial of a number",
    "finds the largest number in a list", "checks whether a number is prime", "sorts a list with bubble sort",
    "merges two sorted lists", "removes duplicates from a list", "converts Celsius to Fahrenheit",
    "reads a text file and counts its words", "computes the greatest common divisor",
    "flattens a nested list", "checks whether two strings are anagrams", "finds the median of a list",
    "implements binary search", "counts word frequencies in a sentence", "generates the first n primes",
    "validates an email address with a regular expression", "transposes a matrix",
    "computes the sum of the digits of a number", "capitalizes every word in a sentence",
    "returns the second largest element of a list", "converts a binary string to an integer",
    "implements a simple stack class", "rotates a list by k positions",
]
CHAT_TOPICS = [
    "learning a new language", "saving money", "sleeping better", "starting to run", "making friends in a new city",
    "staying motivated", "writing a resume", "preparing for an exam", "keeping a plant alive", "cooking rice",
    "organizing my desk", "reducing stress", "planning a trip to Japan", "learning to play guitar",
    "talking to my boss about a raise", "drinking more water", "reading more books", "waking up early",
    "choosing a laptop", "training a puppy", "giving a presentation", "eating healthier", "learning to code",
    "decorating a small apartment", "writing a thank-you note", "getting over a cold", "budgeting for college",
]
TEMPLATES = {
    "factual": [
        "Explain {t} to a ten-year-old.", "What are the most important facts about {t}?",
        "Give a short overview of {t}.", "Why is {t} important?", "Describe how {t} works.",
        "What is the history of {t}?", "Write three paragraphs about {t}.", "What are common myths about {t}?",
        "Summarize what scientists know about {t}.", "Tell me something surprising about {t}.",
    ],
    "story": [
        "Write a short story about {t}.", "Tell me a bedtime story about {t}.",
        "Write a poem about {t}.", "Write the first chapter of a novel about {t}.",
        "Describe a day in the life of {t}.", "Write a funny story about {t}.",
        "Write a fairy tale about {t}.", "Write a dialogue between two characters about {t}.",
    ],
    "code": [
        "Write a Python function that {t}.", "Write a JavaScript function that {t}.",
        "Show me a short Python program that {t}, with comments.", "Write a C function that {t}.",
        "Explain step by step how to write a function that {t}.", "Write a Python function that {t} and add a test.",
    ],
    "chat": [
        "Can you give me some tips for {t}?", "I need advice on {t}.", "What is the best way to get started with {t}?",
        "Make a one-week plan for {t}.", "What mistakes should I avoid when {t}?", "Help me with {t}.",
        "Write a short checklist for {t}.", "What do experts recommend about {t}?",
    ],
}
TOPICS = {"factual": FACTUAL_TOPICS, "story": STORY_TOPICS, "code": CODE_TOPICS, "chat": CHAT_TOPICS}


def training_prompts(seed: int = 0) -> list[str]:
    """Every template × topic combination, shuffled deterministically, minus the held-out prompts."""
    held_out = set(held_out_prompts())
    prompts = [template.format(t=topic) for kind, templates in TEMPLATES.items()
               for template in templates for topic in TOPICS[kind]]
    prompts = [p for p in prompts if p not in held_out]
    random.Random(seed).shuffle(prompts)
    return prompts
