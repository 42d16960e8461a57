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


# The broad set (session 7). The template set above repeats 1,222 prompts across its shards, and a
# draft trained on it partly memorises the target's answers to them: teacher-forced acceptance on
# those prompts ran 0.63 against 0.46 on the held-out benchmark prompts. These prompts widen the
# phrasing and the subjects, and each is used once.
BROAD_SUBJECTS = [
    "compound interest", "the French language", "a vegetable garden", "public speaking", "a used car",
    "jet lag", "the violin", "chess openings", "home insulation", "a wedding toast", "bird watching",
    "credit scores", "meditation", "the Pythagorean theorem", "machine learning", "a camping trip",
    "houseplants", "a small business", "sourdough bread", "a rainy weekend", "the Spanish flu",
    "electric cars", "the stock exchange", "photosynthesis in algae", "a marathon", "renting an apartment",
    "a job offer", "a cover letter", "time zones", "the Fibonacci sequence", "recursion", "unit tests",
    "git branches", "a REST API", "regular expressions", "a linked list", "spreadsheets", "passwords",
    "phishing emails", "a birthday party", "a road trip", "a museum visit", "learning to swim",
    "knitting", "a book club", "the Great Depression", "the Maya civilization", "the Nile river",
    "volunteering", "a science fair project", "origami", "stargazing", "tea", "coffee brewing",
    "a first aid kit", "wildfires", "snow", "the human skeleton", "vitamins", "a family reunion",
    "a noisy neighbour", "a late homework assignment", "a team meeting", "procrastination",
    "a long flight", "a rainy day at the beach", "a treehouse", "an old photograph", "a lighthouse",
    "a street market", "a broken umbrella", "a village festival", "a winter storm", "a new puppy",
    "bicycle repair", "a leaky faucet", "the piano", "jazz", "impressionist painting", "haiku",
    "the Beatles", "the Moon", "Mars", "comets", "the Sahara", "the Arctic", "octopuses", "elephants",
    "ants", "owls", "sharks", "the human eye", "memory", "habits", "gratitude", "a difficult conversation",
]
BROAD_TEMPLATES = [
    "What should I know about {t}?", "Give me five facts about {t}.", "Explain {t} in one paragraph.",
    "How would you explain {t} to a beginner?", "List the pros and cons of {t}.",
    "Write a short poem about {t}.", "Write a limerick about {t}.", "Tell me a short story involving {t}.",
    "Write a diary entry about {t}.", "Write an email to a friend about {t}.",
    "Write a short speech about {t}.", "What questions should I ask about {t}?",
    "Give me a step-by-step guide to {t}.", "What is a common misconception about {t}?",
    "Compare {t} with something similar.", "Write a product description for something related to {t}.",
    "Write a short dialogue about {t}.", "Summarize {t} in three bullet points.",
    "Why do people care about {t}?", "What are the first steps to learn about {t}?",
    "Write a haiku about {t}.", "Write a news headline and a short article about {t}.",
    "I'm curious about {t}. Where do I start?", "What would a child find interesting about {t}?",
    "Write a quiz with three questions about {t}.", "Describe {t} using simple words.",
    "What is the history behind {t}?", "Give me a fun fact about {t} and explain it.",
    "Write a motivational message about {t}.", "What are some tips for dealing with {t}?",
    "Write a letter to your future self about {t}.", "Write a short blog post about {t}.",
]
CODE_TASKS = [
    "parses a CSV line into fields", "checks if a year is a leap year", "counts the lines in a file",
    "returns the n-th triangular number", "finds all even numbers in a list", "zips two lists into a dictionary",
    "computes the average of a list", "checks balanced parentheses", "converts a string to title case",
    "finds the longest word in a sentence", "computes a running total", "removes whitespace from a string",
    "implements a queue with two stacks", "checks if a list is sorted", "finds the mode of a list",
    "converts minutes to hours and minutes", "generates a random password", "computes the power set of a list",
    "merges two dictionaries", "counts the characters in a string", "finds the index of an element",
    "converts a dictionary to a JSON string", "chunks a list into pieces of size n", "reverses the words in a sentence",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.", "How do I write code that {t}? Use Python.",
    "Write a Rust function that {t}.", "Write a Java method that {t}.", "Write a Go function that {t}.",
    "Write a TypeScript function that {t}.", "Explain and implement a function that {t}.",
    "Write a shell script that {t}.", "Give me a one-line Python expression that {t}.",
    "Write a Python class whose method {t}.", "Write pseudocode for an algorithm that {t}.",
    "Fix and explain a buggy Python function that {t}.",
]

# Prompts no training set uses, with their own templates and subjects: the draft's held-out
# curve on them measures generalisation, not memorised answers.
UNSEEN_SUBJECTS = [
    "a rainy Monday", "quantum computers", "a lemonade stand", "the Titanic", "a broken laptop",
    "mountain climbing", "the printing of money", "a lost wallet", "the Aztecs", "a school play",
    "wind turbines", "a fishing trip", "a surprise gift", "cheese making", "the human liver", "lightning",
]
UNSEEN_TEMPLATES = [
    "Could you write a few sentences about {t}?", "Teach me something about {t}.",
    "Write a two-paragraph story that starts with {t}.", "What would you tell a friend about {t}?",
]
UNSEEN_CODE = [
    "Write a Python function that returns the digits of a number in reverse order.",
    "Write a Python function that counts how many times each letter appears in a word.",
    "Write a JavaScript function that capitalizes the first letter of a string.",
    "Write a Python function that returns the sum of the squares of a list.",
]


def broad_prompts(seed: int = 0) -> list[str]:
    """The broad set: subjects × open templates, plus code tasks × languages and phrasings."""
    held_out = set(held_out_prompts()) | set(unseen_prompts())
    prompts = [template.format(t=subject) for template in BROAD_TEMPLATES for subject in BROAD_SUBJECTS]
    prompts += [template.format(t=task) for template in CODE_TEMPLATES for task in CODE_TASKS]
    prompts = [p for p in prompts if p not in held_out]
    random.Random(seed).shuffle(prompts)
    return prompts


def unseen_prompts() -> list[str]:
    """The validation prompts: templates and subjects used by no training set."""
    return [template.format(t=subject) for template in UNSEEN_TEMPLATES for subject in UNSEEN_SUBJECTS] + UNSEEN_CODE


PROMPT_SETS = {"templates": training_prompts, "broad": broad_prompts, "unseen": lambda seed=0: unseen_prompts()}
VALIDATION_SET = "unseen"  # written to its own folder, never trained on
