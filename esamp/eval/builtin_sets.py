"""Small task sets written for this project, shipped as Python data so they install with the
package.

``ARITH``: 40 one- and two-step arithmetic word problems with whole-number answers. The
published sets (AIME, MATH-500, HumanEval) are far beyond a 135M model, whose Pass@k there is 0
for every k and so says nothing about exploration. On these, SmolLM2-135M-Instruct gets about a
quarter of its samples right (pass@1 0.24, pass@8 0.58 at T 0.8 with 256 tokens), with most
solved problems between 1/8 and 7/8, which leaves room for Pass@k to move in either direction.

``OPEN``: 24 open-ended prompts with no single right answer, for semantic diversity.
"""

from __future__ import annotations

# (id, question, answer)
ARITH: list[tuple[str, str, str]] = [
    ("arith-01", "What is 7 + 5?", "12"),
    ("arith-02", "Tom has 3 apples and buys 4 more. How many apples does he have now?", "7"),
    ("arith-03", "What is 6 times 4?", "24"),
    ("arith-04", "A box holds 10 pencils. Sara takes 3 pencils out. How many pencils are left in the box?", "7"),
    ("arith-05", "What is 15 - 8?", "7"),
    ("arith-06", "What is 23 + 19?", "42"),
    ("arith-07", "There are 4 bags with 5 marbles in each bag. How many marbles are there in total?", "20"),
    ("arith-08", "What is 48 divided by 6?", "8"),
    ("arith-09", "A pizza is cut into 8 slices. Ben eats 3 slices. How many slices are left?", "5"),
    ("arith-10", "What is 9 times 9?", "81"),
    (
        "arith-11",
        "Lily reads 12 pages on Monday and 15 pages on Tuesday. How many pages does she read in the two days?",
        "27",
    ),
    ("arith-12", "What is 100 - 37?", "63"),
    ("arith-13", "A farmer has 6 cows. Each cow has 4 legs. How many legs do the cows have altogether?", "24"),
    ("arith-14", "What is 56 + 44?", "100"),
    ("arith-15", "Twenty cookies are shared equally among 4 children. How many cookies does each child get?", "5"),
    ("arith-16", "What is 12 times 3?", "36"),
    ("arith-17", "A bus has 30 seats. 18 seats are taken. How many seats are empty?", "12"),
    ("arith-18", "What is 81 divided by 9?", "9"),
    ("arith-19", "Maria has 5 red balloons and 7 blue balloons. How many balloons does she have?", "12"),
    ("arith-20", "What is 14 + 27?", "41"),
    ("arith-21", "A book costs 8 dollars. How much do 3 books cost, in dollars?", "24"),
    ("arith-22", "What is 50 - 26?", "24"),
    ("arith-23", "There are 7 days in a week. How many days are there in 5 weeks?", "35"),
    ("arith-24", "What is 11 times 11?", "121"),
    ("arith-25", "Sam had 25 stickers. He gave 9 stickers to his friend. How many stickers does Sam have now?", "16"),
    ("arith-26", "What is 72 divided by 8?", "9"),
    (
        "arith-27",
        "A garden has 3 rows of flowers with 9 flowers in each row. How many flowers are in the garden?",
        "27",
    ),
    ("arith-28", "What is 35 + 46?", "81"),
    ("arith-29", "Anna is 9 years old. Her brother is 4 years older than her. How old is her brother?", "13"),
    ("arith-30", "What is 90 - 45?", "45"),
    ("arith-31", "A car travels 60 kilometers each hour. How many kilometers does it travel in 3 hours?", "180"),
    ("arith-32", "What is 7 times 8?", "56"),
    (
        "arith-33",
        "Jack has 2 boxes of crayons with 12 crayons in each box. He loses 5 crayons. "
        "How many crayons does he have left?",
        "19",
    ),
    ("arith-34", "What is 64 divided by 4?", "16"),
    (
        "arith-35",
        "A shop sold 14 shirts in the morning and 11 shirts in the afternoon. How many shirts did it sell that day?",
        "25",
    ),
    ("arith-36", "What is 125 + 75?", "200"),
    (
        "arith-37",
        "Emma buys 4 notebooks at 3 dollars each and pays with a 20-dollar bill. "
        "How much change does she get, in dollars?",
        "8",
    ),
    ("arith-38", "What is 13 times 5?", "65"),
    ("arith-39", "A class has 28 students. Half of them are girls. How many girls are in the class?", "14"),
    ("arith-40", "What is 1000 - 1?", "999"),
]

ARITH_INSTRUCTION = "Give the final answer as a number."

# (id, prompt)
OPEN: list[tuple[str, str]] = [
    ("open-01", "Write a two-sentence story about a lighthouse keeper."),
    ("open-02", "Suggest a name for a new coffee shop and explain it in one sentence."),
    ("open-03", "Describe an unusual use for a paperclip."),
    ("open-04", "Write a short poem about rain."),
    ("open-05", "Give one tip for staying focused while studying."),
    ("open-06", "Invent a new holiday and say how people celebrate it."),
    ("open-07", "Describe the taste of an imaginary fruit."),
    ("open-08", "Write the opening line of a mystery novel."),
    ("open-09", "What would you pack for a trip to the moon? Name three things."),
    ("open-10", "Describe a city in the year 2200."),
    ("open-11", "Write a short letter from a cat to its owner."),
    ("open-12", "Suggest a fun weekend activity for a family."),
    ("open-13", "Invent a board game and describe its main rule."),
    ("open-14", "Write a haiku about autumn leaves."),
    ("open-15", "Describe a robot that helps in the kitchen."),
    ("open-16", "Give a creative title for a song about friendship and say what it is about."),
    ("open-17", "Tell a short joke about computers."),
    ("open-18", "Describe your ideal treehouse."),
    ("open-19", "Write a one-paragraph fairy tale about a brave mouse."),
    ("open-20", "Name a superpower you would like and explain why."),
    ("open-21", "Describe a sunset to someone who has never seen one."),
    ("open-22", "Invent a new sport and explain how to score points."),
    ("open-23", "Write a motivational message for someone starting a new job."),
    ("open-24", "Describe a dream you might have after eating too much cheese."),
]
