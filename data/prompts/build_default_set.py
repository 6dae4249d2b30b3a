"""Build the default prompt set, ``default.jsonl``, for the dflash pipeline.

What it builds
    A JSON-lines file of about 2,700 English prompts, one object per line::

        {"prompt": "...", "category": "coding"}
        {"prompt": "...", "category": "coding", "split": "val"}

    ``category`` is one of ``coding``, ``math``, ``explain`` or ``chat``
    (roughly 35 / 25 / 20 / 20 per cent).

Why
    A speculative-decoding drafter has to predict what the *target* model
    (SmolLM2-135M-Instruct) would say next. The pipeline therefore feeds these
    prompts to the target, lets it regenerate the answers, and trains the
    drafter on the target's own outputs. The prompts only need to be varied
    enough that the regenerated answers cover the target's distribution:
    code, step-by-step arithmetic, explanations and everyday chat.

    The evaluation story of the project is about classic coding tasks
    (FizzBuzz, binary search, an LRU cache, ...). Those prompts are pinned to
    the validation split (``"split": "val"``), written first in the file, and
    the training prompts are filtered so that none of them asks for the same
    task.

How
    Everything is generated offline from hand-written templates and lists in
    this file; nothing is downloaded and nothing is copied from an external
    data set. Coding prompts come from task lists in several languages, small
    code snippets to explain or fix, and a fixed list of standard-library
    callables (names and purposes are written out here, docstrings are not
    read, so the output does not depend on the Python version). Math prompts
    are sampled with ``random.Random`` from fixed seeds. Explain and chat
    prompts are templates over hand-written lists.

    After the pinned validation rows, the categories are interleaved
    round-robin (coding, math, explain, chat, coding, ...) so that a prefix of
    the file is a balanced mix: the pipeline uses the first N rows for small
    runs. Each category is shuffled with a fixed seed first, so a prefix also
    mixes the template families within a category. When the smaller
    categories run out (after roughly 2,100 rows), the round-robin continues
    over the ones that are left, so the tail is mostly coding and math.

    The output is deterministic: no clock, only seeded randomness, no
    iteration over sets. Running the script twice gives a byte-identical file.

Usage
    python data/prompts/build_default_set.py [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

CATEGORIES = ("coding", "math", "explain", "chat")

# Prompts are kept short so that the target's answer, not the prompt,
# dominates each training sequence.
MAX_PROMPT_WORDS = 70

# One fixed seed for everything random; each use derives its own generator
# from it so that editing one family does not reshuffle the others.
BASE_SEED = 20_241_202

DEFAULT_OUT_PATH = Path(__file__).resolve().parent / "default.jsonl"


# ---------------------------------------------------------------------------
# Pinned validation prompts (coding classics from the evaluation story)
# ---------------------------------------------------------------------------

VALIDATION_CODING_PROMPTS = (
    "Write a Python function fizzbuzz(n) that returns a list of strings for the numbers 1 to n, using \"Fizz\" for multiples of 3, \"Buzz\" for multiples of 5 and \"FizzBuzz\" for multiples of both.",
    "Implement binary search in Python: write a function that takes a sorted list and a target value and returns the index of the target, or -1 if it is not present.",
    "Implement an LRU cache class in Python with get(key) and put(key, value) methods that both run in O(1) time, evicting the least recently used entry when the capacity is exceeded.",
    "Write a Python function that reverses a singly linked list in place and returns the new head node.",
    "Write a Python function that performs a breadth-first search on a graph given as an adjacency list and returns the shortest path between two nodes.",
    "Solve the two-sum problem in Python: given a list of integers and a target, return the indices of the two numbers that add up to the target.",
    "Write a Python function that checks whether a string of parentheses, brackets and braces is valid, meaning every opening symbol is closed in the correct order.",
    "Write a Python function that merges overlapping intervals, for example [[1, 3], [2, 6], [8, 10]] becomes [[1, 6], [8, 10]].",
    "Implement quicksort in Python and explain how the choice of pivot affects its running time.",
    "Implement Dijkstra's algorithm in Python to find the shortest distances from a source node in a weighted graph, using a priority queue.",
    "Implement a trie (prefix tree) in Python with insert, search and starts_with methods.",
    "Write a Python function that rotates an n x n matrix by 90 degrees clockwise in place.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and punctuation.",
    "Write a Python program that counts how often each word appears in a text and prints the ten most frequent words.",
    "Write a Python function that flattens an arbitrarily nested list, for example [1, [2, [3, 4]], 5] becomes [1, 2, 3, 4, 5].",
    "Write a Python function that returns the nth Fibonacci number, first recursively with memoization and then iteratively.",
    "Write a Python function that groups a list of words into anagrams, for example [\"eat\", \"tea\", \"tan\", \"ate\", \"nat\"].",
    "Write a Python function that detects whether a linked list has a cycle using Floyd's tortoise-and-hare algorithm.",
    "Write a Python function that finds the maximum sum of a contiguous subarray using Kadane's algorithm.",
    "Write a Python function that merges two sorted lists into one sorted list without using the built-in sort.",
    "Write a Python function that returns the length of the longest substring without repeating characters.",
    "Write a Python function that returns all prime numbers up to n using the Sieve of Eratosthenes.",
    "Write a Python function that converts a Roman numeral string such as \"MCMXCIV\" to an integer.",
    "Implement a min stack in Python that supports push, pop, top and get_min, all in O(1) time.",
)

# Training coding prompts that mention any of these topics are dropped, so the
# validation tasks above are never seen in training under another wording.
VALIDATION_TOPIC_PATTERNS = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"fizz\s*buzz",
        r"binary search(?! tree)",
        r"\blru\b",
        r"least recently used",
        r"linked list",
        r"breadth-first|\bbfs\b",
        r"two-sum|two sum",
        r"parenthes|bracket",
        r"intervals",
        r"quick\s*sort",
        r"dijkstra",
        r"\btrie\b|prefix tree",
        r"rotat\w* .*matrix|matrix .*rotat",
        r"palindrom",
        r"word (count|frequenc)|frequent words|common words",
        r"flatten",
        r"fibonacci",
        r"anagram",
        r"kadane|maximum sum of a contiguous|max(imum)? subarray",
        r"merges? two sorted",
        r"longest substring",
        r"sieve|prime numbers up to",
        r"roman numeral",
        r"min stack|get_min",
    )
)


# ---------------------------------------------------------------------------
# Coding data
# ---------------------------------------------------------------------------

# Completions of "... a function that {task}". Written to be language-neutral
# so some of them can be reused for JavaScript.
GENERAL_FUNCTION_TASKS = (
    "returns the second largest number in a list",
    "removes duplicates from a list while keeping the original order",
    "counts the vowels in a string",
    "capitalizes the first letter of every word in a sentence",
    "checks whether a number is prime",
    "computes the factorial of a non-negative integer",
    "returns the greatest common divisor of two integers",
    "converts a temperature from Celsius to Fahrenheit",
    "checks whether a year is a leap year",
    "returns the sum of the digits of an integer",
    "reverses the order of words in a sentence",
    "finds the most frequent element in a list",
    "splits a list into chunks of a given size",
    "rotates a list to the right by k positions",
    "returns the intersection of two lists without duplicates",
    "checks whether two strings are equal ignoring case and surrounding spaces",
    "converts a decimal number to its binary representation as a string",
    "converts a binary string to an integer",
    "counts the number of set bits in an integer",
    "finds the missing number in a list containing 1 to n with one number absent",
    "returns the running average of a list of numbers",
    "computes the median of a list of numbers",
    "computes the mode of a list of numbers",
    "normalizes a list of numbers so that they sum to 1",
    "clamps a number to a given minimum and maximum",
    "formats a number of seconds as hours, minutes and seconds",
    "parses a date string in the form YYYY-MM-DD and returns the day of the week",
    "returns the number of days between two dates",
    "validates that a string looks like an email address",
    "masks all but the last four digits of a credit card number",
    "converts a string to snake_case",
    "converts a snake_case string to camelCase",
    "truncates a string to a maximum length and adds an ellipsis",
    "removes all punctuation from a string",
    "compresses a string using run-length encoding, so aaabb becomes a3b2",
    "decodes a run-length encoded string",
    "checks whether a string contains only unique characters",
    "finds the first non-repeating character in a string",
    "counts how many times a substring occurs in a string, including overlapping matches",
    "returns the longest common prefix of a list of strings",
    "checks whether one string is a rotation of another",
    "zips two lists into a dictionary",
    "inverts a dictionary so that values become keys",
    "merges two dictionaries, summing the values of shared keys",
    "sorts a list of dictionaries by a given key",
    "groups a list of records by the value of one field",
    "returns the n largest values from a list without sorting the whole list",
    "computes the dot product of two vectors",
    "multiplies two matrices given as nested lists",
    "transposes a matrix given as a list of lists",
    "checks whether a 9x9 Sudoku board is valid",
    "generates all subsets of a small list",
    "generates all permutations of a string",
    "computes the power set size and lists the subsets of size k",
    "converts an integer to its English words, for example 42 becomes forty-two",
    "computes compound interest given principal, rate and years",
    "calculates the body mass index from weight and height",
    "checks whether a number is a perfect square without using floating point",
    "computes the integer square root of a number with Newton's method",
    "returns the digits of a number in reverse order",
    "checks whether a number is an Armstrong number",
    "finds all pairs in a list whose difference equals k",
    "moves all zeros in a list to the end while keeping the order of the other elements",
    "returns the product of all elements except the current one for each position in a list",
    "finds the majority element in a list, if one exists",
    "counts the islands of 1s in a grid of 0s and 1s",
    "computes the edit distance between two strings",
    "computes the length of the longest common subsequence of two strings",
    "computes the minimum number of coins needed to make an amount",
    "counts the number of ways to climb n stairs taking 1 or 2 steps at a time",
    "solves the 0/1 knapsack problem for small inputs",
    "finds the longest increasing subsequence of a list",
    "computes Pascal's triangle up to n rows",
    "checks whether a graph given as an adjacency list contains a cycle",
    "returns a topological ordering of tasks given their dependencies",
    "counts connected components in an undirected graph",
    "performs a depth-first traversal of a tree and returns the visited values",
    "computes the height of a binary tree",
    "checks whether a binary tree is a valid binary search tree",
    "returns the level-order values of a binary tree as a list of lists",
    "finds the lowest common ancestor of two nodes in a binary search tree",
    "serializes a binary tree to a string and back",
    "implements insertion sort",
    "implements merge sort",
    "implements bubble sort and stops early when the list is already sorted",
    "implements counting sort for small non-negative integers",
    "finds the kth smallest element in an unsorted list",
    "checks whether a list is sorted in ascending order",
    "returns the indices where a value appears in a list",
    "interleaves two lists of possibly different lengths",
    "computes a moving average over a sliding window of size k",
    "finds the maximum value in each sliding window of size k",
    "evaluates a simple arithmetic expression in reverse Polish notation",
    "converts a hexadecimal color code like #FF8800 to an RGB tuple",
    "converts an RGB tuple to a hexadecimal color code",
    "generates a random password of a given length with letters, digits and symbols",
    "shuffles a list using the Fisher-Yates algorithm",
    "simulates rolling two dice many times and reports how often each total appears",
    "estimates pi with a Monte Carlo simulation",
    "checks whether a point lies inside a rectangle",
    "computes the distance between two latitude and longitude points with the haversine formula",
    "computes the area of a polygon from its vertices",
    "parses a query string like a=1&b=2 into a dictionary",
    "builds a URL query string from a dictionary",
    "pretty-prints a table of rows with aligned columns",
    "reads a text file and returns the number of lines, words and characters",
    "returns the file extension of a filename, or an empty string if there is none",
    "converts a list of key=value lines into a dictionary",
    "deep-merges two nested dictionaries",
    "safely gets a value from a nested dictionary using a dotted path like a.b.c",
    "retries another function up to three times when it raises an exception",
    "converts a number of bytes into a human-readable size like 1.5 MB",
    "checks whether a version string like 1.10.2 is newer than another",
    "splits a full name into first and last name",
    "counts the words in a sentence that are longer than five letters",
    "finds the longest word in a sentence",
    "returns the acronym of a phrase, for example Portable Network Graphics becomes PNG",
    "implements the Caesar cipher for encryption and decryption",
    "checks whether a string is a valid IPv4 address",
    "converts a 24-hour time string to 12-hour format",
    "generates the first n rows of a multiplication table",
    "computes the Collatz sequence starting from n",
    "returns the prime factors of an integer",
    "computes the least common multiple of a list of integers",
    "checks whether two rectangles overlap",
    "computes the angle between the hour and minute hands of a clock",
    "converts a list of temperatures and returns the daily highs and lows",
    "returns a histogram of letter frequencies as a dictionary",
    "checks whether a sentence is a pangram",
    "removes HTML tags from a string",
    "wraps text to a given line width without breaking words",
    "implements a simple tokenizer that splits text into words and numbers",
    "returns the nth triangular number",
    "computes the cumulative sum of a list",
    "finds the element that appears only once when every other element appears twice",
    "finds the start and end positions of a target in a sorted list with duplicates",
    "counts the inversions in a list",
    "implements a bounded queue that drops the oldest item when full",
    "converts a flat list of parent-child pairs into a nested tree of dictionaries",
    "simulates a bank account with deposit and withdraw that rejects overdrafts",
    "schedules meetings by returning the minimum number of rooms needed",
    "computes the number of business days between two dates",
    "validates a password against length, digit and uppercase rules",
)

# Templates for the Python variant of the general tasks; rotated so that no
# single phrasing dominates.
PYTHON_FUNCTION_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include type hints and a docstring.",
    "Implement a Python function that {task}, and show two example calls.",
    "In Python, write a function that {task}. Keep it short and readable.",
    "Write a Python function that {task}, then explain its time complexity.",
    "Write a Python function that {task}. Handle edge cases such as empty input.",
)

# Every JAVASCRIPT_REUSE_STEP-th general task also gets a JavaScript prompt.
JAVASCRIPT_REUSE_STEP = 4
JAVASCRIPT_FUNCTION_TEMPLATES = (
    "Write a JavaScript function that {task}.",
    "Write a JavaScript function that {task}. Use modern ES6 syntax.",
    "Implement a JavaScript function that {task}, and show how to call it.",
)

# Tasks that only make sense in a browser or Node.js setting.
JAVASCRIPT_SPECIFIC_PROMPTS = (
    "Write a JavaScript debounce function and show how to use it on a search input.",
    "Write a JavaScript throttle function that limits a scroll handler to once every 200 ms.",
    "Write a JavaScript function that deep-clones a plain object without using JSON.stringify.",
    "Write JavaScript that fetches JSON from a URL with fetch and async/await, and handles errors.",
    "Write a JavaScript function that formats a number as US currency using Intl.NumberFormat.",
    "Write JavaScript that adds a click handler to every button with the class \"like\" and toggles its text.",
    "Write a small Express.js server with one GET route that returns the current server time as JSON.",
    "Write a JavaScript function that reads a query parameter from the current page URL.",
    "Write a JavaScript function that saves an object to localStorage and reads it back.",
    "Write a JavaScript promise-based sleep function and use it in an async loop.",
    "Show how to run three fetch requests in parallel in JavaScript with Promise.all.",
    "Write a JavaScript class for a simple event emitter with on, off and emit methods.",
    "Write a JavaScript function that creates an HTML list from an array of strings and inserts it into the page.",
    "Write a JavaScript function that validates a form and shows an error message when the email field is empty.",
    "Write a JavaScript function that sorts an array of objects by date, newest first.",
    "Write a JavaScript function that groups an array of objects by a property name.",
    "Write a JavaScript function that counts down from 10 to 0, updating a page element every second.",
    "Write a Node.js script that reads a text file line by line and prints the number of lines.",
    "Write a JavaScript function that memoizes another function with a single argument.",
    "Write a JavaScript function that copies text to the clipboard when a button is clicked.",
    "Explain the difference between let, const and var in JavaScript with short examples.",
    "Explain how the JavaScript event loop runs promises and setTimeout callbacks, with a small example.",
    "Write a JavaScript function that returns the unique values of an array using a Set.",
    "Write a JavaScript function that converts an array of key-value pairs into an object.",
    "Write a small React component that shows a counter with increment and decrement buttons.",
    "Write a JavaScript function that lazy-loads images when they scroll into view using IntersectionObserver.",
    "Write TypeScript types for a blog post with a title, body, tags and an optional published date.",
    "Write a JavaScript function that pads a number with leading zeros to a fixed width.",
    "Write a JavaScript function that returns a random integer between two values, inclusive.",
    "Write JavaScript that toggles a dark mode class on the body and remembers the choice.",
)

# (schema, task) pairs for SQL prompts.
SQL_TASKS = (
    ("employees(id, name, department, salary)", "returns the highest-paid employee in each department"),
    ("employees(id, name, department, salary)", "returns the average salary per department, highest first"),
    ("employees(id, name, manager_id)", "lists each employee together with the name of their manager"),
    ("employees(id, name, department, salary)", "finds departments with more than five employees"),
    ("employees(id, name, hire_date)", "lists employees hired in the last 30 days"),
    ("orders(id, customer_id, total, created_at)", "returns the total revenue per month"),
    ("orders(id, customer_id, total, created_at)", "finds the top five customers by total spending"),
    ("orders(id, customer_id, total, created_at)", "finds customers who placed an order in January but not in February"),
    ("orders(id, customer_id, total, created_at)", "computes a running total of revenue ordered by date"),
    ("orders(id, customer_id, total, created_at) and customers(id, name, country)", "returns the number of orders per country"),
    ("customers(id, name, email)", "finds duplicate email addresses"),
    ("customers(id, name, email) and orders(id, customer_id, total)", "lists customers who have never placed an order"),
    ("products(id, name, price, category)", "returns the three most expensive products in each category"),
    ("products(id, name, price, category)", "increases the price of all products in the 'books' category by 10 percent"),
    ("products(id, name, stock)", "deletes products that have been out of stock for a year, given a last_restocked column"),
    ("students(id, name) and grades(student_id, course, score)", "returns each student's average score, rounded to one decimal place"),
    ("students(id, name) and grades(student_id, course, score)", "finds students who scored above the course average in every course"),
    ("page_views(user_id, url, viewed_at)", "counts the number of distinct users per day"),
    ("page_views(user_id, url, viewed_at)", "finds the ten most visited URLs this week"),
    ("logins(user_id, login_at)", "finds users who logged in on three consecutive days"),
    ("logins(user_id, login_at)", "returns each user's first and last login time"),
    ("transactions(id, account_id, amount, created_at)", "returns the current balance of every account"),
    ("transactions(id, account_id, amount, created_at)", "flags accounts with more than 10 transactions in one hour"),
    ("books(id, title, author_id) and authors(id, name)", "lists authors with the number of books they have written, including authors with none"),
    ("movies(id, title, year, rating)", "returns the best-rated movie of each year"),
    ("movies(id, title, year, rating)", "computes the median rating of all movies"),
    ("sensor_readings(sensor_id, value, recorded_at)", "returns the latest reading from each sensor"),
    ("sensor_readings(sensor_id, value, recorded_at)", "computes the hourly average value per sensor"),
    ("tickets(id, status, opened_at, closed_at)", "returns the average time to close a ticket, in hours"),
    ("events(id, name, starts_at, ends_at)", "finds pairs of events whose time ranges overlap"),
)

SQL_TEMPLATES = (
    "Given a table {schema}, write a SQL query that {task}.",
    "Write a SQL query for the table {schema} that {task}. Explain each clause briefly.",
)

SQL_GENERAL_PROMPTS = (
    "Explain the difference between INNER JOIN, LEFT JOIN and FULL OUTER JOIN in SQL with a small example.",
    "Write the SQL to create a table for blog posts with an id, title, body, author and created timestamp.",
    "Explain what a SQL index is and write a statement that creates one on a users table's email column.",
    "Show how to use a common table expression (WITH clause) in SQL to simplify a query with a subquery.",
    "Explain the difference between WHERE and HAVING in SQL with an example.",
    "Show how to use a window function like ROW_NUMBER() in SQL to number rows within each group.",
    "Write SQL statements to insert, update and delete a row in a table named tasks.",
    "Explain what a SQL transaction is and show how to transfer money between two accounts safely.",
)

# Completions of "... a bash script that {task}" and similar.
BASH_TASKS = (
    "finds all files larger than 100 MB under the current directory",
    "counts the lines of code in all .py files in a project",
    "renames every .jpeg file in a folder to .jpg",
    "prints the ten most common IP addresses in an Apache access log",
    "backs up a directory into a tar.gz archive named with today's date",
    "deletes log files older than 14 days",
    "replaces the word \"foo\" with \"bar\" in every .txt file in a folder",
    "checks whether a website returns HTTP 200 and prints a message if it does not",
    "monitors a file and prints new lines as they are added",
    "lists the five largest directories under /var",
    "prints the disk usage of the current folder in human-readable form",
    "loops over the lines of a file and prints each one with its line number",
    "creates a new project folder with src, tests and docs subfolders",
    "kills the process listening on port 8080",
    "prints the number of unique values in the second column of a CSV file",
    "downloads a list of URLs from a text file, one per line",
    "compresses every .log file in a directory with gzip",
    "prints the current git branch name in a script",
    "asks the user for a name and greets them",
    "runs a command and retries it up to five times if it fails",
    "sorts a file by its third column numerically",
    "finds which files contain the word TODO, recursively",
    "prints the memory usage of the top five processes",
    "converts all filenames in a directory to lowercase",
    "checks if a directory exists and creates it if it does not",
    "prints every environment variable whose name starts with APP_",
    "splits a large file into pieces of 10,000 lines each",
    "extracts the email addresses from a text file and removes duplicates",
)

BASH_TEMPLATES = (
    "Write a bash script that {task}.",
    "Write a bash one-liner that {task}, and explain each part.",
    "How can I write a shell command that {task}?",
)

# Completions of "Write a C {kind} that ...".
C_TASKS = (
    "function that reverses a string in place",
    "function that counts the words in a string",
    "program that reads integers from standard input and prints their average",
    "function that swaps two integers using pointers",
    "function that returns the length of a string without using strlen",
    "function that copies one array into another and returns the number of elements copied",
    "program that prints a multiplication table from 1 to 10",
    "function that checks whether an integer is a power of two",
    "function that finds the largest element of an integer array",
    "program that copies one file to another using fopen, fread and fwrite",
    "struct for a 2D point and a function that computes the distance between two points",
    "function that dynamically allocates an array of n integers and fills it with squares",
    "function that converts a string of digits to an integer without atoi",
    "function that sorts an array of integers with selection sort",
    "program that counts the characters, words and lines in a text file",
    "function that removes trailing whitespace from a string",
    "function that implements a simple stack of integers with push and pop on a fixed-size array",
    "program that prints the binary representation of an unsigned integer",
    "function that compares two strings ignoring case",
    "function that concatenates two strings into a newly allocated buffer",
    "program that uses a switch statement to build a tiny calculator",
    "function that computes the average of an array of doubles",
    "function that counts how many times a character appears in a string",
    "program that reads a line of text safely with fgets and prints it reversed",
)

C_TEMPLATES = (
    "Write a C {task}.",
    "Write a C {task}. Add comments that explain each step.",
)

C_GENERAL_PROMPTS = (
    "Explain the difference between the stack and the heap in C with a short example.",
    "Explain what a segmentation fault is in C and show code that causes one.",
    "Explain pointers in C with a small example that changes a variable through a pointer.",
    "What is the difference between malloc and calloc in C? Show an example of each.",
    "Explain what a memory leak is in C and how to fix one with free.",
    "Explain what the static keyword does in C for variables and functions.",
)

# (name, behaviour) for "Write a Python class ..." prompts.
PYTHON_CLASS_TASKS = (
    ("BankAccount", "supports deposits, withdrawals and a transaction history"),
    ("Temperature", "stores a value in Celsius and exposes Fahrenheit and Kelvin properties"),
    ("ShoppingCart", "adds items with quantities, removes them and computes the total with tax"),
    ("Rectangle", "computes its area and perimeter and can be compared by area"),
    ("Stopwatch", "can be started, stopped and reset, and reports the elapsed time"),
    ("Inventory", "tracks product quantities and warns when one runs low"),
    ("Matrix", "supports addition, multiplication and a readable string representation"),
    ("Vector2D", "supports addition, scaling with *, length and equality"),
    ("TodoList", "adds tasks, marks them done and lists the ones still open"),
    ("RateLimiter", "allows at most n calls per minute for each user"),
    ("Library", "lets members borrow and return books and lists overdue loans"),
    ("Polynomial", "can be evaluated at x and added to another polynomial"),
    ("Fraction", "stores a numerator and denominator in lowest terms and supports + and *"),
    ("Queue", "is built from two stacks and supports enqueue and dequeue"),
    ("CircularBuffer", "has a fixed capacity and overwrites the oldest value when full"),
    ("Graph", "stores an undirected graph and can list the neighbours of a node"),
    ("Timer", "works as a context manager and prints how long the block took"),
    ("Money", "stores an amount and a currency and refuses to add different currencies"),
    ("Student", "stores grades per subject and computes a weighted average"),
    ("ParkingLot", "assigns the nearest free spot to each arriving car"),
    ("Config", "loads settings from a dictionary and allows attribute-style access"),
    ("Counter", "can be incremented safely from several threads"),
    ("Deck", "represents a deck of 52 playing cards that can be shuffled and dealt"),
    ("Employee", "has a subclass Manager that adds a list of direct reports"),
    ("EventLog", "records timestamped events and returns the events in a time range"),
    ("Playlist", "adds songs, skips to the next one and shuffles the order"),
)

PYTHON_CLASS_TEMPLATES = (
    "Write a Python class {name} that {behaviour}.",
    "Design a Python class called {name} that {behaviour}. Show a short usage example.",
)

# Short snippets for "explain this code" prompts. Kept tiny so the prompt
# stays short.
CODE_SNIPPETS_TO_EXPLAIN = (
    ("Python", "squares = [x * x for x in range(10) if x % 2 == 0]"),
    ("Python", "counts = {}\nfor ch in text:\n    counts[ch] = counts.get(ch, 0) + 1"),
    ("Python", "with open(\"data.txt\") as f:\n    lines = [line.strip() for line in f if line.strip()]"),
    ("Python", "result = sorted(people, key=lambda p: (p.age, p.name))"),
    ("Python", "def gen(n):\n    for i in range(n):\n        yield i * 2"),
    ("Python", "a, b = b, a"),
    ("Python", "total = sum(price * qty for price, qty in cart)"),
    ("Python", "evens = list(filter(lambda n: n % 2 == 0, numbers))"),
    ("Python", "matrix = [[0] * cols for _ in range(rows)]"),
    ("Python", "name = user.get(\"name\") or \"guest\""),
    ("Python", "try:\n    value = int(text)\nexcept ValueError:\n    value = 0"),
    ("Python", "first, *middle, last = [1, 2, 3, 4, 5]"),
    ("Python", "pairs = dict(zip(keys, values))"),
    ("Python", "def add(x, items=[]):\n    items.append(x)\n    return items"),
    ("Python", "@property\ndef full_name(self):\n    return f\"{self.first} {self.last}\""),
    ("Python", "if __name__ == \"__main__\":\n    main()"),
    ("Python", "words = text.lower().split()\nunique = sorted(dict.fromkeys(words))"),
    ("Python", "while True:\n    line = input()\n    if line == \"quit\":\n        break\n    print(line.upper())"),
    ("JavaScript", "const doubled = nums.map(n => n * 2).filter(n => n > 10);"),
    ("JavaScript", "const { name, age = 30 } = person;"),
    ("JavaScript", "const total = items.reduce((sum, item) => sum + item.price, 0);"),
    ("JavaScript", "document.querySelector(\"#btn\").addEventListener(\"click\", () => alert(\"Hi\"));"),
    ("JavaScript", "const copy = { ...original, updated: true };"),
    ("JavaScript", "setTimeout(() => console.log(\"later\"), 0);\nconsole.log(\"now\");"),
    ("JavaScript", "const unique = [...new Set(tags)];"),
    ("SQL", "SELECT department, COUNT(*) AS n\nFROM employees\nGROUP BY department\nHAVING COUNT(*) > 3;"),
    ("SQL", "SELECT name FROM customers WHERE id NOT IN (SELECT customer_id FROM orders);"),
    ("bash", "find . -name \"*.log\" -mtime +7 -delete"),
    ("bash", "cat access.log | cut -d' ' -f1 | sort | uniq -c | sort -rn | head"),
    ("bash", "for f in *.txt; do mv \"$f\" \"${f%.txt}.md\"; done"),
    ("C", "for (int i = 0; i < n / 2; i++) {\n    int t = a[i];\n    a[i] = a[n - 1 - i];\n    a[n - 1 - i] = t;\n}"),
    ("C", "int *p = malloc(n * sizeof *p);\nif (p == NULL) return -1;"),
)

EXPLAIN_CODE_TEMPLATES = (
    "Explain what this {language} code does:\n\n{code}",
    "What does the following {language} code do, step by step?\n\n{code}",
)

# (language, code, hint) for "fix the bug" prompts. The hint says what goes
# wrong, which is how a user would usually report it.
BUGGY_SNIPPETS = (
    ("Python", "def average(nums):\n    return sum(nums) / len(nums) - 1", "it returns the wrong average"),
    ("Python", "def last_item(items):\n    return items[len(items)]", "it raises an IndexError"),
    ("Python", "for i in range(1, 10):\n    print(i)", "it should print 1 to 10 but stops at 9"),
    ("Python", "def is_even(n):\n    if n % 2 == 1:\n        return True\n    return False", "it returns the opposite of what it should"),
    ("Python", "total = 0\nfor price in prices:\n    total = price\nprint(total)", "it does not print the sum of the prices"),
    ("Python", "name = input(\"Age: \")\nprint(\"Next year you will be\", name + 1)", "it crashes with a TypeError"),
    ("Python", "def greet(name):\n    print(\"Hello, \" + name)\n\nmessage = greet(\"Ana\")\nprint(message.upper())", "it fails with an AttributeError"),
    ("Python", "for item in items:\n    if item < 0:\n        items.remove(item)", "some negative numbers are not removed"),
    ("Python", "def count_words(text):\n    return len(text.split(\" \"))", "it gives the wrong count when there are double spaces"),
    ("Python", "def append_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket", "items from earlier calls show up in later calls"),
    ("Python", "data = {\"a\": 1}\nprint(data[\"b\"])", "it raises a KeyError instead of printing a default"),
    ("Python", "if x = 5:\n    print(\"five\")", "it is a syntax error"),
    ("Python", "def max_of(nums):\n    best = 0\n    for n in nums:\n        if n > best:\n            best = n\n    return best", "it is wrong when all the numbers are negative"),
    ("Python", "f = open(\"out.txt\")\nf.write(\"hello\")", "it cannot write to the file"),
    ("Python", "copy = original\ncopy.append(4)", "the original list also changes"),
    ("Python", "result = 0.1 + 0.2\nif result == 0.3:\n    print(\"equal\")", "it never prints equal"),
    ("Python", "class Dog:\n    def bark():\n        print(\"Woof\")\n\nDog().bark()", "it raises a TypeError"),
    ("Python", "import threading\ncount = 0\ndef work():\n    global count\n    for _ in range(100000):\n        count += 1", "the final count is sometimes too small when run in threads"),
    ("JavaScript", "if (value == null || value = \"\") {\n  return false;\n}", "it throws an error"),
    ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}", "it prints 3 three times"),
    ("JavaScript", "const nums = [10, 1, 5];\nnums.sort();\nconsole.log(nums);", "the numbers are not sorted numerically"),
    ("JavaScript", "async function load() {\n  const data = fetch(\"/api\").json();\n  return data;\n}", "it fails because json is not a function"),
    ("JavaScript", "const total = \"5\" + 3;", "total is \"53\" instead of 8"),
    ("SQL", "SELECT name, COUNT(*) FROM orders;", "the database rejects the query"),
    ("SQL", "SELECT * FROM users WHERE email = NULL;", "it returns no rows even though some emails are missing"),
    ("bash", "for f in $(ls *.txt); do echo $f; done", "it breaks on file names with spaces"),
    ("C", "char *s = \"hello\";\ns[0] = 'H';", "it crashes at run time"),
    ("C", "int sum(int *a, int n) {\n    int total;\n    for (int i = 0; i <= n; i++) total += a[i];\n    return total;\n}", "it returns garbage values"),
)

FIX_BUG_TEMPLATES = (
    "Fix the bug in this {language} code: {hint}.\n\n{code}",
    "This {language} code has a bug, {hint}. Explain the problem and give a corrected version.\n\n{code}",
)

# Everyday "how do I" questions about programming.
CODING_HOW_TO_QUESTIONS = (
    "How do I read a CSV file in Python and skip the header row?",
    "How do I create and activate a virtual environment in Python?",
    "How do I install a package with pip and pin its version in requirements.txt?",
    "How do I handle exceptions in Python so that my program does not crash on bad input?",
    "How do I make an HTTP GET request in Python and parse the JSON response?",
    "How do I write unit tests in Python with pytest? Show a small example.",
    "How do I format a float to two decimal places in Python?",
    "How do I iterate over a dictionary's keys and values at the same time in Python?",
    "How do I sort a dictionary by its values in Python?",
    "How do I remove a key from a dictionary in Python without raising an error if it is missing?",
    "How do I check whether a file exists in Python before opening it?",
    "How do I get the current date and time in Python and print it in a readable format?",
    "How do I use list slicing in Python to reverse a list or take every second element?",
    "How do I read command-line arguments in a Python script?",
    "How do I undo the last git commit but keep my changes?",
    "How do I resolve a merge conflict in git?",
    "How do I create a new git branch and push it to a remote repository?",
    "How do I write a .gitignore file for a Python project?",
    "How do I profile a slow Python function to see where the time goes?",
    "How do I use f-strings in Python? Show a few examples with numbers and dates.",
    "How do I run two Python functions at the same time?",
    "How do I debug a Python script with breakpoints?",
    "How do I write a Dockerfile for a small Python web app?",
    "How do I convert a list of strings to a list of integers in Python?",
    "How do I merge two lists in Python and keep only unique items?",
    "How do I split a long Python script into several modules?",
    "How do I write a generator in Python, and when should I use one instead of a list?",
    "How do I write a simple decorator in Python that logs each function call?",
    "How do I read a large file in Python without loading it all into memory?",
    "How do I make a Python class printable with a useful string representation?",
    "How do I add type hints to a Python function that accepts either a string or None?",
    "How do I schedule a Python script to run every day at 6 AM on Linux?",
    "How do I connect to a SQLite database from Python and run a query?",
    "How do I plot a simple line chart in Python?",
    "How do I parse a date string with a time zone in Python?",
    "How do I write a recursive function in Python, and how do I avoid infinite recursion?",
    "How do I make my Python code follow PEP 8? Which tools can help?",
    "How do I create a simple REST API in Python with Flask?",
    "What is the difference between a list and a tuple in Python, and when should I use each?",
    "What is the difference between == and is in Python?",
    "What is the difference between a shallow copy and a deep copy in Python?",
    "What are *args and **kwargs in Python? Show an example.",
    "What does the yield keyword do in Python?",
    "What is a Python virtual environment and why should I use one?",
    "What is the difference between a process and a thread, from a programmer's point of view?",
    "What is Big O notation? Give examples of O(1), O(n) and O(n^2) code in Python.",
    "What is a race condition? Show a small Python example and how to prevent it.",
    "What is dependency injection? Explain with a short Python example.",
    "What are Python's mutable and immutable types? Give examples of each.",
    "What is the difference between a class method, a static method and an instance method in Python?",
)

# (callable, purpose) pairs from Python's standard library. The purposes are
# hand-written so the prompts do not depend on docstrings, which change
# between Python versions.
STDLIB_CALLABLES = (
    ("textwrap.dedent", "remove the common leading indentation from a multi-line string"),
    ("textwrap.wrap", "wrap a long paragraph into lines of at most 40 characters"),
    ("textwrap.fill", "print a long description as a neatly wrapped block of text"),
    ("textwrap.shorten", "shorten a long article title to fit in 30 characters"),
    ("textwrap.indent", "indent every line of a code block by four spaces"),
    ("itertools.groupby", "group consecutive log lines by their date"),
    ("itertools.chain", "iterate over several lists as if they were one"),
    ("itertools.chain.from_iterable", "join a list of lists of tags into a single list"),
    ("itertools.combinations", "list every possible pair of players in a tournament"),
    ("itertools.permutations", "print every ordering of three letters"),
    ("itertools.product", "build all size and color combinations of a T-shirt"),
    ("itertools.accumulate", "compute running totals of daily sales"),
    ("itertools.islice", "read only the first 10 lines of a large file"),
    ("itertools.cycle", "assign incoming jobs to workers in rotating order"),
    ("itertools.count", "number items starting from 100 in steps of 5"),
    ("itertools.repeat", "create a list of default values without a loop"),
    ("itertools.zip_longest", "pair up two lists of different lengths, filling gaps with a default"),
    ("itertools.takewhile", "read numbers from a list until the first negative one"),
    ("itertools.dropwhile", "skip the comment lines at the top of a file"),
    ("itertools.starmap", "apply a function to a list of argument tuples"),
    ("itertools.tee", "iterate over the same data stream twice"),
    ("itertools.compress", "select items from a list using a list of booleans"),
    ("itertools.pairwise", "compute the differences between consecutive temperature readings"),
    ("itertools.filterfalse", "keep only the lines of a file that are not blank"),
    ("collections.Counter", "count how many times each letter appears in a sentence"),
    ("collections.Counter.most_common", "find the three most common HTTP status codes in a list of responses"),
    ("collections.Counter.update", "keep a running tally of votes as new ballots arrive"),
    ("collections.defaultdict", "group students by their grade without checking for missing keys"),
    ("collections.deque", "keep only the last five commands a user typed"),
    ("collections.deque.rotate", "rotate a list of players so the next one starts"),
    ("collections.deque.appendleft", "add items to the front of a queue efficiently"),
    ("collections.OrderedDict.move_to_end", "move a recently updated setting to the end of an ordered mapping"),
    ("collections.namedtuple", "represent 2D points with named x and y fields"),
    ("collections.ChainMap", "layer command-line options over environment settings and defaults"),
    ("functools.lru_cache", "cache the results of a slow function that looks up exchange rates"),
    ("functools.cache", "speed up a recursive function that counts paths in a grid"),
    ("functools.partial", "create a version of int() that always parses base-2 strings"),
    ("functools.reduce", "multiply all the numbers in a list together"),
    ("functools.wraps", "write a timing decorator that keeps the wrapped function's name and docstring"),
    ("functools.total_ordering", "make a Version class fully comparable by defining only __eq__ and __lt__"),
    ("functools.cached_property", "compute an expensive attribute of an object only once"),
    ("functools.singledispatch", "format values differently depending on their type"),
    ("functools.cmp_to_key", "sort strings with a custom comparison function"),
    ("operator.itemgetter", "sort a list of dictionaries by their 'age' key"),
    ("operator.attrgetter", "sort a list of objects by their last_name attribute"),
    ("operator.methodcaller", "call the same method on every object in a list"),
    ("json.dumps", "pretty-print a nested dictionary with sorted keys"),
    ("json.loads", "parse a JSON string received from a web API"),
    ("json.dump", "save user settings to a JSON file"),
    ("json.load", "read a JSON configuration file and print one of its values"),
    ("csv.reader", "read a CSV file row by row and skip the header"),
    ("csv.writer", "write a list of tuples to a CSV file"),
    ("csv.DictReader", "compute the average of one column in a CSV file"),
    ("csv.DictWriter", "export a list of dictionaries to a CSV file with a header row"),
    ("re.search", "find the first date in a block of text"),
    ("re.fullmatch", "check that a string is a valid five-digit postal code"),
    ("re.findall", "extract all email addresses from a text"),
    ("re.sub", "collapse repeated spaces in a string into a single space"),
    ("re.split", "split a string on commas, semicolons or spaces"),
    ("re.compile", "reuse one regular expression to validate many phone numbers"),
    ("re.finditer", "print each hashtag in a tweet with its position"),
    ("re.escape", "search for a user-supplied string that may contain special characters"),
    ("pathlib.Path.glob", "list all .txt files in a folder"),
    ("pathlib.Path.rglob", "find every Python file in a project, including subfolders"),
    ("pathlib.Path.read_text", "load a small text file into a string"),
    ("pathlib.Path.write_text", "save a generated report to a file"),
    ("pathlib.Path.mkdir", "create a nested output folder if it does not exist yet"),
    ("pathlib.Path.with_suffix", "change a file name's extension from .txt to .md"),
    ("pathlib.Path.exists", "check whether a configuration file is present before loading it"),
    ("pathlib.Path.iterdir", "list the entries of a folder and mark which ones are directories"),
    ("os.walk", "find the largest file under a directory tree"),
    ("os.path.join", "build file paths that work on both Windows and Linux"),
    ("os.path.splitext", "separate a file name from its extension"),
    ("os.environ.get", "read a configuration value from an environment variable with a default"),
    ("os.makedirs", "create a folder and all of its missing parent folders"),
    ("os.listdir", "print the names of the files in the current folder"),
    ("os.scandir", "list files in a folder together with their sizes"),
    ("os.getcwd", "print the current working directory"),
    ("shutil.copy2", "copy a file while keeping its modification time"),
    ("shutil.rmtree", "delete a temporary build folder and everything in it"),
    ("shutil.make_archive", "zip up a folder of reports"),
    ("shutil.which", "check whether a command-line tool such as git is installed"),
    ("shutil.disk_usage", "report how much free disk space is left"),
    ("shutil.move", "move processed files into an archive folder"),
    ("subprocess.run", "run a shell command and capture its output"),
    ("subprocess.check_output", "get the current git commit hash from inside a script"),
    ("sys.getsizeof", "compare the memory size of a list and a tuple"),
    ("sys.exit", "stop a script with an error code when an input file is missing"),
    ("argparse.ArgumentParser", "build a command-line tool with a --verbose flag"),
    ("argparse.ArgumentParser.add_argument", "accept an input file and an optional number of retries"),
    ("logging.basicConfig", "log messages with timestamps to a file"),
    ("logging.getLogger", "give each module of an application its own logger"),
    ("datetime.datetime.strptime", "parse timestamps like '2024-03-15 14:30'"),
    ("datetime.datetime.strftime", "print a date as 'Friday, 15 March 2024'"),
    ("datetime.timedelta", "compute the date 90 days from today"),
    ("datetime.date.fromisoformat", "turn ISO date strings into date objects and sort them"),
    ("datetime.datetime.now", "print a greeting that depends on the time of day"),
    ("time.perf_counter", "measure how long a function takes to run"),
    ("time.sleep", "poll a status every five seconds"),
    ("calendar.monthrange", "find how many days a given month has"),
    ("calendar.isleap", "count the leap years between 1900 and 2100"),
    ("zoneinfo.ZoneInfo", "convert a meeting time from New York time to Tokyo time"),
    ("math.isclose", "compare two floating-point results safely"),
    ("math.gcd", "reduce a fraction to lowest terms"),
    ("math.lcm", "find when two repeating events next happen on the same day"),
    ("math.comb", "count the ways to choose 5 cards from a deck of 52"),
    ("math.factorial", "count the ways to arrange books on a shelf"),
    ("math.hypot", "compute the distance between two points on a plane"),
    ("math.ceil", "work out how many boxes are needed to pack a number of items"),
    ("math.floor", "convert a number of seconds to whole minutes"),
    ("math.log", "compute how many times a number can be halved before it drops below 1"),
    ("math.prod", "compute the product of a list of numbers"),
    ("math.dist", "find the closest shop to a customer's location"),
    ("math.isqrt", "check whether a large integer is a perfect square"),
    ("statistics.mean", "compute the average of a list of exam scores"),
    ("statistics.median", "find the median house price in a list"),
    ("statistics.stdev", "measure how spread out a set of measurements is"),
    ("statistics.mode", "find the most common shoe size in a survey"),
    ("statistics.quantiles", "split a list of response times into quartiles"),
    ("random.choice", "pick a random quote of the day from a list"),
    ("random.sample", "draw six unique lottery numbers from 1 to 49"),
    ("random.shuffle", "shuffle a quiz's questions before each attempt"),
    ("random.seed", "make a random simulation reproducible"),
    ("random.randint", "simulate rolling a six-sided die"),
    ("random.choices", "pick prizes at random with different weights"),
    ("decimal.Decimal", "add up money amounts without floating-point errors"),
    ("decimal.Decimal.quantize", "round a price to exactly two decimal places"),
    ("fractions.Fraction", "add 1/3 and 1/6 exactly"),
    ("heapq.heappush", "keep a to-do list ordered by priority"),
    ("heapq.heappop", "always process the most urgent task next"),
    ("heapq.nlargest", "find the five highest scores in a long list"),
    ("heapq.nsmallest", "find the three cheapest flights in a list of offers"),
    ("heapq.merge", "combine several already-sorted lists of timestamps lazily"),
    ("bisect.bisect_left", "find where a new score belongs in a sorted leaderboard"),
    ("bisect.bisect_right", "map exam scores to letter grades using cut-off points"),
    ("bisect.insort", "insert values into a list while keeping it sorted"),
    ("string.Template", "fill in a simple email template with a name and a date"),
    ("string.capwords", "turn a lowercase title into title case"),
    ("str.maketrans", "replace several characters in a string in one pass"),
    ("str.partition", "split a 'key=value' line into its key and value"),
    ("str.removeprefix", "strip a fixed prefix from a list of file names"),
    ("str.zfill", "pad invoice numbers with leading zeros"),
    ("str.casefold", "compare user names without caring about letter case"),
    ("str.splitlines", "process a multi-line string one line at a time"),
    ("str.join", "build a comma-separated list of names"),
    ("enumerate", "print a numbered shopping list starting at 1"),
    ("zip", "loop over names and scores at the same time"),
    ("sorted", "sort words by length and then alphabetically"),
    ("any", "check whether any file in a list is missing"),
    ("all", "check that every field of a form has been filled in"),
    ("isinstance", "handle numbers and strings differently in one function"),
    ("getattr", "call a method whose name is chosen at run time"),
    ("divmod", "convert minutes into hours and minutes"),
    ("round", "round prices and understand how it rounds halves"),
    ("max", "find the longest word in a list using a key function"),
    ("reversed", "loop over a list from the end without copying it"),
    ("iter", "read fixed-size chunks from a file until it is exhausted"),
    ("next", "get the first item in a list that matches a condition"),
    ("open", "append a line to a log file"),
    ("print", "print values separated by commas without a trailing newline"),
    ("dict.setdefault", "build a dictionary that maps each letter to a list of words"),
    ("dict.get", "look up prices with a fallback for unknown items"),
    ("list.sort", "sort a list of tuples in place by their second element"),
    ("dataclasses.dataclass", "define a Book type with a title, author and year"),
    ("dataclasses.field", "give a dataclass a list attribute with an empty default"),
    ("dataclasses.asdict", "convert a dataclass instance to a dictionary for JSON output"),
    ("dataclasses.replace", "create a modified copy of a frozen dataclass"),
    ("enum.Enum", "represent the states of a traffic light"),
    ("enum.auto", "define enum members without typing their values"),
    ("typing.NamedTuple", "define a typed record for a city with a name and population"),
    ("typing.TypedDict", "describe the shape of a JSON object returned by an API"),
    ("contextlib.contextmanager", "write a context manager that temporarily changes the working directory"),
    ("contextlib.suppress", "delete a file without failing if it does not exist"),
    ("contextlib.ExitStack", "open a variable number of files safely"),
    ("contextlib.redirect_stdout", "capture what a function prints into a string"),
    ("tempfile.TemporaryDirectory", "run a test in a scratch folder that is removed afterwards"),
    ("tempfile.NamedTemporaryFile", "write data to a temporary file and pass its name to another tool"),
    ("glob.glob", "find all CSV files whose names start with 'sales_'"),
    ("fnmatch.fnmatch", "check whether file names match a pattern like '*.jpg'"),
    ("hashlib.sha256", "compute the checksum of a large file in chunks"),
    ("hmac.compare_digest", "compare two secret tokens safely"),
    ("secrets.token_hex", "generate a random API token"),
    ("secrets.choice", "generate a strong random password"),
    ("uuid.uuid4", "give each uploaded file a unique identifier"),
    ("base64.b64encode", "encode an image file as text"),
    ("base64.b64decode", "decode a base64 string back into bytes"),
    ("urllib.parse.urlparse", "split a URL into its scheme, host and path"),
    ("urllib.parse.urlencode", "build a query string from a dictionary of parameters"),
    ("urllib.parse.quote", "encode a search term so it is safe to put in a URL"),
    ("threading.Thread", "download several files at the same time"),
    ("threading.Lock", "protect a shared counter that several threads update"),
    ("concurrent.futures.ThreadPoolExecutor", "check the status of many websites in parallel"),
    ("concurrent.futures.ProcessPoolExecutor", "resize many images using all CPU cores"),
    ("multiprocessing.Pool", "square a large list of numbers in parallel"),
    ("queue.Queue", "pass work from a producer thread to a consumer thread"),
    ("asyncio.run", "start a small asynchronous program"),
    ("asyncio.gather", "run three asynchronous tasks at once and collect their results"),
    ("asyncio.sleep", "write an asynchronous countdown"),
    ("asyncio.wait_for", "give up on a slow asynchronous operation after two seconds"),
    ("asyncio.Queue", "share work between asynchronous producer and consumer tasks"),
    ("sqlite3.connect", "create a small table, insert a few rows and query them"),
    ("pickle.dumps", "save a Python object to bytes and restore it"),
    ("copy.deepcopy", "copy a nested dictionary so that changes do not affect the original"),
    ("pprint.pprint", "print a deeply nested data structure in a readable way"),
    ("difflib.SequenceMatcher", "measure how similar two strings are"),
    ("difflib.get_close_matches", "suggest the closest command name when a user makes a typo"),
    ("difflib.unified_diff", "show the differences between two versions of a text"),
    ("unicodedata.normalize", "compare strings that contain accented characters reliably"),
    ("shlex.split", "split a command line into arguments while respecting quotes"),
    ("struct.pack", "write integers and floats into a binary record"),
    ("struct.unpack", "read the width and height from the header of a binary file"),
    ("zipfile.ZipFile", "list the contents of a zip archive and extract one file"),
    ("gzip.open", "read a compressed log file line by line"),
    ("tarfile.open", "create a .tar.gz archive of a folder"),
    ("io.StringIO", "treat a string as a file when testing a CSV parser"),
    ("configparser.ConfigParser", "read database settings from an .ini file"),
    ("tomllib.load", "read project settings from a pyproject.toml file"),
    ("timeit.timeit", "compare the speed of two ways to build a list"),
    ("traceback.format_exc", "log the full error details when an exception is caught"),
    ("warnings.warn", "tell users that a function is deprecated"),
    ("abc.abstractmethod", "define a Shape base class that every subclass must complete with an area method"),
    ("inspect.signature", "print the parameters a function accepts"),
    ("array.array", "store a million integers compactly"),
    ("ipaddress.ip_network", "check whether an IP address belongs to a subnet"),
    ("ipaddress.ip_address", "tell IPv4 and IPv6 addresses apart"),
    ("email.message.EmailMessage", "build an email with a subject, body and attachment"),
    ("html.escape", "show user input safely inside an HTML page"),
    ("xml.etree.ElementTree.fromstring", "read values out of a small XML document"),
    ("graphlib.TopologicalSorter", "order build steps so that each runs after its dependencies"),
    ("platform.system", "run different code on Windows, macOS and Linux"),
    ("getpass.getpass", "ask for a password without showing it on screen"),
    ("shelve.open", "keep a small persistent dictionary on disk"),
    ("weakref.WeakValueDictionary", "cache objects without keeping them alive forever"),
    ("locale.format_string", "format numbers with the thousands separator of the user's locale"),
    ("math.radians", "convert compass bearings from degrees before using trigonometry"),
)

# A usage-oriented template and a purpose-oriented template are used for
# every callable, each rotated through its own list.
STDLIB_USAGE_TEMPLATES = (
    "Show how to use `{name}` in Python with a short example.",
    "Explain when to use `{name}` in Python and show a short example.",
    "What does `{name}` do in Python? Explain briefly with an example.",
)
STDLIB_PURPOSE_TEMPLATES = (
    "Write a small program that uses `{name}` to {purpose}.",
    "Using `{name}`, show Python code to {purpose}.",
    "How can I use `{name}` in Python to {purpose}? Show the code.",
    "Write a short Python example that uses `{name}` to {purpose}, and explain it.",
)

# Every TEST_PROMPT_STEP-th general task also gets a "write tests" prompt.
TEST_PROMPT_STEP = 5
UNIT_TEST_TEMPLATES = (
    "Write pytest unit tests for a Python function that {task}. Cover the edge cases.",
    "Write a few unittest test cases for a function that {task}.",
)


# ---------------------------------------------------------------------------
# Math data
# ---------------------------------------------------------------------------

PERSON_NAMES = (
    "Ava", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hiro", "Isla",
    "Jamal", "Kira", "Liam", "Maya", "Noah", "Olivia", "Priya", "Quinn",
    "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe", "Lucas",
    "Mei", "Omar", "Sofia", "Tom",
)

# (plural item, lowest price in cents, highest price in cents)
SHOP_ITEMS = (
    ("notebooks", 150, 450), ("pens", 50, 200), ("apples", 30, 90),
    ("loaves of bread", 200, 450), ("cartons of milk", 120, 300),
    ("movie tickets", 800, 1500), ("T-shirts", 900, 2500),
    ("bags of rice", 250, 700), ("packs of batteries", 300, 900),
    ("cups of coffee", 250, 550), ("bus tickets", 150, 350),
    ("plant pots", 400, 1200), ("paintbrushes", 150, 600),
    ("bottles of juice", 150, 400), ("sandwiches", 350, 800),
)

MATH_STEP_SUFFIXES = (
    "Show your work step by step.",
    "Explain each step of your reasoning.",
    "Solve it step by step.",
    "Work through it step by step and state the final answer.",
    "Give a step-by-step solution.",
)

# Number of unique prompts drawn from each math family.
MATH_PROMPTS_PER_FAMILY = 38


# ---------------------------------------------------------------------------
# Explain data
# ---------------------------------------------------------------------------

EXPLAIN_CONCEPTS = (
    # computing
    "recursion", "a hash table", "an API", "cloud computing", "machine learning",
    "a neural network", "encryption", "a compiler", "an operating system",
    "a database index", "version control", "open-source software", "a firewall",
    "a computer virus", "two-factor authentication",
    "Moore's law", "bandwidth", "latency", "caching", "a CPU", "RAM",
    "a solid-state drive", "a web browser", "DNS", "an IP address",
    "HTTP", "cookies in web browsers", "a VPN", "phishing", "an algorithm",
    "Big O notation", "object-oriented programming", "functional programming",
    "a bug in software", "unit testing", "continuous integration", "containers like Docker",
    "virtual machines", "blockchain", "a large language model", "overfitting in machine learning",
    "a pixel", "image compression", "binary numbers", "floating-point numbers",
    "Unicode", "a programming language", "an operating system kernel", "multithreading",
    "garbage collection", "a deadlock", "public-key cryptography", "a hash function",
    "speculative decoding in language models", "tokenization in language models",
    "a GPU", "quantum computing", "the Internet of Things", "a data center",
    "open standards", "a QR code", "a password manager", "data backups",
    # science
    "photosynthesis", "gravity", "evolution by natural selection", "DNA",
    "the water cycle", "plate tectonics", "the greenhouse effect", "climate change",
    "the immune system", "vaccines", "antibiotic resistance", "black holes",
    "the Big Bang", "atoms", "chemical bonds", "acids and bases", "electricity",
    "magnetism", "sound waves", "the speed of light", "relativity",
    "the periodic table", "entropy", "energy conservation", "friction",
    "inertia", "buoyancy", "the seasons on Earth", "the phases of the Moon",
    "tides", "a solar eclipse", "the ozone layer", "biodiversity",
    "the food chain", "cells", "genes", "metabolism", "the nervous system",
    "sleep", "nuclear fission", "nuclear fusion",
    "radioactivity", "renewable energy", "solar panels", "wind turbines",
    "batteries", "semiconductors", "the scientific method",
    "statistical significance", "correlation versus causation", "probability",
    "exponential growth", "the Doppler effect", "volcanoes", "earthquakes",
    "hurricanes", "rainbows", "static electricity", "the human heart",
    "blood types", "allergies", "fermentation", "the carbon cycle",
    # history and society
    "the Industrial Revolution", "the Renaissance", "the printing press",
    "the Roman Republic", "the Silk Road", "the French Revolution",
    "the Cold War", "the space race", "the Magna Carta", "democracy",
    "the separation of powers", "the United Nations", "colonialism",
    "the Agricultural Revolution", "the fall of the Berlin Wall",
    "the invention of writing", "ancient Egyptian pyramids", "feudalism",
    "the Enlightenment", "the civil rights movement", "the Great Depression",
    "the history of the internet", "the Olympic Games", "human rights",
    "a constitution", "federalism", "the census", "propaganda",
    # economics and money
    "inflation", "interest rates", "compound interest", "supply and demand",
    "a recession", "the stock market", "bonds", "index funds", "diversification",
    "a credit score", "a mortgage", "taxes", "a budget", "opportunity cost",
    "gross domestic product", "unemployment", "central banks", "exchange rates",
    "trade deficits", "a monopoly", "competition in markets", "globalization",
    "cryptocurrency", "insurance", "a pension", "minimum wage", "economies of scale",
    "the gig economy", "a startup", "venture capital", "marketing", "branding",
    "a business plan", "profit margin", "depreciation", "a balance sheet",
    # everyday life
    "a nutrition label", "a balanced diet", "calories",
    "hydration", "a healthy sleep routine", "mindfulness", "procrastination",
    "habit formation", "time management", "active listening", "emotional intelligence",
    "critical thinking", "basic first aid", "recycling", "composting",
    "a carbon footprint", "energy-efficient appliances", "a car engine",
    "electric cars", "public transport", "jet lag", "sunscreen and UV rays",
    "the placebo effect", "cognitive biases", "confirmation bias", "the sunk cost fallacy",
    "negotiation", "a growth mindset", "stress", "burnout", "ergonomics",
    "a warranty", "a lease agreement", "copyright", "fair use",
    "privacy online", "misinformation", "net neutrality",
    # arts and language
    "metaphor", "irony", "a sonnet", "the hero's journey in stories",
    "perspective in drawing", "the color wheel", "rhythm in music",
    "a symphony orchestra", "jazz improvisation", "impressionism in painting",
    "the rule of thirds in photography", "grammar", "the passive voice",
    "language change over time", "dialects", "etymology",
    # added breadth
    "a sorting algorithm", "a binary tree", "a graph in computer science",
    "a REST API", "JSON", "a regular expression", "a spreadsheet formula",
    "a command-line interface", "open Wi-Fi risks", "software licenses",
    "the water table", "ocean currents", "the life cycle of a star",
    "the Milky Way", "pollination", "plant respiration",
    "the placebo effect in medical trials", "herd immunity", "the microbiome",
    "the Bronze Age", "the Ottoman Empire", "the Meiji Restoration",
    "the Marshall Plan", "the abolition of slavery", "the scramble for Africa",
    "price elasticity", "a trade tariff", "a universal basic income",
    "crowdfunding", "a credit union", "a stock split", "a dividend",
)

EXPLAIN_CONCEPT_TEMPLATES = (
    "Explain {concept} in simple terms.",
    "Explain {concept} briefly, with an everyday example.",
    "Explain {concept} to someone with no background in the subject.",
    "Give a short, beginner-friendly explanation of {concept}.",
    "Explain {concept} in simple terms and say why it matters.",
    "Explain {concept} to a 12-year-old.",
)

EXPLAIN_DIFFERENCE_PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "storage"),
    ("a compiler", "an interpreter"), ("HTTP", "HTTPS"), ("TCP", "UDP"),
    ("a list", "an array"), ("a process", "a thread"), ("AI", "machine learning"),
    ("supervised learning", "unsupervised learning"), ("hardware", "software"),
    ("the internet", "the World Wide Web"), ("a router", "a modem"),
    ("SQL", "NoSQL databases"), ("a stack", "a queue"), ("Git", "GitHub"),
    ("encryption", "hashing"), ("authentication", "authorization"),
    ("a bug", "a feature request"), ("frontend", "backend development"),
    ("a library", "a framework"), ("static typing", "dynamic typing"),
    ("speed", "velocity"), ("mass", "weight"), ("heat", "temperature"),
    ("an element", "a compound"), ("a mixture", "a solution"),
    ("a hypothesis", "a theory"), ("mitosis", "meiosis"),
    ("an asteroid", "a comet"), ("a planet", "a star"),
    ("a hurricane", "a tornado"), ("a lake", "a pond"), ("a sea", "an ocean"),
    ("a frog", "a toad"), ("a crocodile", "an alligator"),
    ("a vaccine", "an antibiotic"), ("a cold", "the flu"),
    ("aerobic", "anaerobic exercise"), ("a fruit", "a vegetable"),
    ("baking soda", "baking powder"), ("nuclear fission", "nuclear fusion"),
    ("AC", "DC electricity"), ("a conductor", "an insulator"),
    ("renewable", "non-renewable energy"), ("a democracy", "a republic"),
    ("a president", "a prime minister"), ("a law", "a regulation"),
    ("the Senate", "the House of Representatives"),
    ("a revolution", "a reform"), ("an empire", "a kingdom"),
    ("stocks", "bonds"), ("saving", "investing"), ("a debit card", "a credit card"),
    ("inflation", "deflation"), ("revenue", "profit"), ("a loan", "a grant"),
    ("fixed", "variable interest rates"), ("a sole proprietorship", "a corporation"),
    ("microeconomics", "macroeconomics"), ("a need", "a want"),
    ("gross pay", "net pay"), ("a budget", "a forecast"),
    ("an ETF", "a mutual fund"), ("a recession", "a depression"),
    ("affect", "effect"), ("fewer", "less"), ("its", "it's"),
    ("a simile", "a metaphor"), ("a novel", "a novella"),
    ("a poem", "song lyrics"), ("fiction", "nonfiction"),
    ("an acronym", "an abbreviation"), ("empathy", "sympathy"),
    ("confidence", "arrogance"), ("a habit", "a routine"),
    ("a résumé", "a cover letter"), ("a manager", "a leader"),
    ("shallow", "deep work"), ("introverts", "extroverts"),
    ("a latte", "a cappuccino"), ("broiling", "baking"),
    ("a hotel", "a hostel"), ("a visa", "a passport"),
    ("a warranty", "a guarantee"), ("renting", "buying a home"),
    ("a hybrid car", "an electric car"), ("4G", "5G"),
    ("Wi-Fi", "Bluetooth"), ("LCD", "OLED screens"),
    ("a laptop", "a tablet"), ("open-source", "proprietary software"),
    ("a spreadsheet", "a database"), ("cloud storage", "a local backup"),
    ("a podcast", "a radio show"), ("a museum", "a gallery"),
    ("baroque", "classical music"), ("a violin", "a viola"),
    ("a tsunami", "a tidal wave"), ("an ape", "a monkey"),
    ("a moth", "a butterfly"), ("a herb", "a spice"),
    ("precision", "accuracy"), ("mean", "median"),
    ("correlation", "causation"), ("a sample", "a population in statistics"),
    ("probability", "odds"), ("a prime number", "a composite number"),
    ("area", "perimeter"), ("a square", "a rhombus"),
    ("a county", "a state"), ("a census", "a survey"), ("a cyclone", "a typhoon"),
    ("an allergy", "an intolerance"), ("a psychologist", "a psychiatrist"),
    ("a virus scan", "a firewall"), ("a URL", "a domain name"),
    ("a bit", "a byte"), ("compiling", "linking a program"),
    ("weathering", "erosion"), ("a geyser", "a hot spring"),
    ("a tax deduction", "a tax credit"), ("a bull market", "a bear market"),
    ("a patent", "a trademark"), ("a rule", "a guideline"),
)

EXPLAIN_DIFFERENCE_TEMPLATES = (
    "What is the difference between {first} and {second}?",
    "How is {first} different from {second}? Explain simply.",
    "Compare {first} and {second} in a few sentences.",
)

EXPLAIN_HOW_THINGS_WORK = (
    "a refrigerator", "GPS", "a microwave oven", "a touchscreen", "Wi-Fi",
    "a search engine", "email", "a credit card payment", "a vaccine",
    "a bicycle gear system", "an airplane wing", "a rocket", "a hot-air balloon",
    "a submarine", "a camera", "noise cancellation in headphones", "a solar panel",
    "a wind turbine", "a nuclear power plant", "a dam", "a heat pump",
    "an electric motor", "a battery", "a light bulb", "a thermostat",
    "a smoke detector", "a pin tumbler lock", "a compass", "a clock",
    "a speaker", "a microphone", "a 3D printer", "a barcode scanner",
    "contactless payment", "a recommendation system", "spam filtering",
    "autocorrect on a phone", "face recognition", "a self-driving car",
    "a blood test", "an MRI scanner", "an X-ray", "the human eye",
    "the human ear", "a kidney", "breathing", "digestion", "a pacemaker",
    "the postal system", "an election", "a jury trial", "a stock exchange",
    "a bank loan", "insurance pricing", "a supply chain", "an auction",
    "a library catalog", "a weather forecast", "a compost pile",
)

EXPLAIN_HOW_TEMPLATES = (
    "How does {thing} work?",
    "How does {thing} work? Explain in simple terms.",
    "Explain how {thing} works, step by step.",
)

# Whole questions, asked the way a curious person would ask them.
EXPLAIN_OPEN_QUESTIONS = (
    "How do bees make honey?",
    "How do birds find their way when they migrate?",
    "How does a seed grow into a plant?",
    "How does a spider build its web?",
    "How does a river carve a canyon?",
    "How do clouds produce rain?",
    "How do snowflakes form?",
    "Why do volcanoes erupt?",
    "Why does bread dough rise?",
    "How does soap remove grease?",
    "How do muscles get stronger with exercise?",
    "How does the brain store memories?",
    "Why do we get a fever when we are sick?",
    "Why is the sky blue?",
    "Why do leaves change color in the autumn?",
    "Why do we have time zones?",
    "Why does ice float on water?",
    "Why do onions make people cry?",
    "Why do cats purr?",
    "Why is the ocean salty?",
    "Why do we get goosebumps?",
    "Why do airplanes leave white trails in the sky?",
    "Why does bread go stale?",
    "Why do we yawn?",
    "Why do some countries drive on the left?",
    "Why is it colder at the top of a mountain?",
    "Why do stars twinkle?",
    "Why does the Moon look bigger near the horizon?",
    "Why do prices usually go up over time?",
    "Why do banks pay interest on savings?",
    "Why are some programming languages faster than others?",
    "Why do computers use binary?",
    "Why does my phone battery drain faster in the cold?",
    "Why do we need to update software?",
    "Why do websites ask me to accept cookies?",
    "Why do we have leap years?",
    "Why do our ears pop on an airplane?",
    "Why do metals feel colder than wood at the same temperature?",
    "Why does a spoon look bent in a glass of water?",
    "Why do we dream?",
    "Why do some people need glasses?",
    "Why is exercise good for the brain?",
    "Why do we sneeze?",
    "Why does popcorn pop?",
    "Why do mirrors flip left and right but not up and down?",
    "Why are there so many languages in the world?",
    "Why did the Roman Empire fall?",
    "Why did the Industrial Revolution start in Britain?",
    "Why do countries trade with each other?",
    "Why do stock prices change every day?",
    "Why do planes fly so high?",
    "Why do we have different blood types?",
    "Why can't we see air?",
    "Why do some materials conduct electricity and others do not?",
    "Why does salt melt ice on roads?",
    "Why do bubbles form when water boils?",
    "Why is sleep important for learning?",
    "Why do hard drives fail eventually?",
    "Why do large companies split software into microservices?",
    "Why is it hard to predict the weather more than a week ahead?",
    "Why do we still use passwords if they are so easy to steal?",
    "Why do cities feel warmer than the countryside at night?",
    "Why does the Earth have a magnetic field?",
    "Why do some birds fly south for the winter?",
    "Why do we need to drink water every day?",
    "Why do apples turn brown after they are cut?",
    "Why are flamingos pink?",
    "Why does a compass point north?",
    "Why do old books smell the way they do?",
    "Why do tomatoes ripen faster in a paper bag?",
    "Why do we have fingerprints?",
    "Why do governments collect taxes?",
    "Why do central banks raise interest rates when prices rise quickly?",
    "Why do computers slow down as they get older?",
    "Why is it important to back up data?",
    "Why do cats land on their feet?",
)


# ---------------------------------------------------------------------------
# Chat data
# ---------------------------------------------------------------------------

EMAIL_SCENARIOS = (
    "to my landlord asking when the broken heater will be fixed",
    "to my manager asking for Friday off next week",
    "to a colleague thanking them for helping with a project",
    "to a customer apologizing for a delayed delivery",
    "to my child's teacher asking about an upcoming school trip",
    "to a hotel asking whether early check-in is possible",
    "to my team announcing a new weekly meeting time",
    "to a professor asking for an extension on an assignment",
    "to a neighbor about a package that was delivered to me by mistake",
    "declining a job offer politely",
    "accepting a job offer and confirming the start date",
    "following up after a job interview",
    "to a friend I have not spoken to in a year",
    "to a gym cancelling my membership",
    "to a restaurant complaining about a cold meal",
    "requesting a refund for a product that arrived damaged",
    "to a client sending an invoice that is now overdue",
    "inviting my coworkers to a farewell lunch",
    "to a conference organizer asking about speaker guidelines",
    "to a mentor asking for a short meeting to get career advice",
    "to a volunteer group offering to help at their next event",
    "to my team summarizing the decisions from today's meeting",
    "to a supplier asking for a price quote for 500 units",
    "to IT support reporting that my laptop will not connect to Wi-Fi",
    "to my bank asking about an unknown charge on my card",
    "to a new employee welcoming them to the team",
    "reminding my book club about Thursday's meeting",
    "to a photographer asking about availability for a wedding",
    "to a dentist rescheduling an appointment",
    "to parents about a change in the soccer practice schedule",
    "thanking a host for a lovely dinner party",
    "to a coworker asking them to review my report by Wednesday",
    "to a city office reporting a broken streetlight",
    "to an online shop asking when an item will be back in stock",
    "introducing two colleagues who should work together",
    "to a recruiter asking for more details about a job posting",
    "to my team saying I will be out sick today",
    "to a landlord giving notice that I am moving out",
)

EMAIL_TEMPLATES = (
    "Write a short email {scenario}.",
    "Write a short, friendly email {scenario}.",
    "Write a brief, professional email {scenario}.",
)

TEXT_MESSAGE_SCENARIOS = (
    "congratulating a friend on a new job",
    "telling a friend I will be 15 minutes late for dinner",
    "wishing my grandmother a happy birthday",
    "cheering up a friend who failed an exam",
    "thanking my neighbor for watering my plants",
    "reminding my roommate to pay the electricity bill",
    "asking a friend if they want to go hiking on Saturday",
    "apologizing to a friend for missing their party",
    "congratulating my sister on her graduation",
    "checking in on a colleague who has been ill",
    "saying goodbye to coworkers on my last day",
    "welcoming a new member to our running club",
    "sending condolences to a friend who lost their dog",
    "inviting the neighbors to a small street party",
)

TEXT_MESSAGE_TEMPLATES = (
    "Write a short text message {scenario}.",
    "Help me write a warm message {scenario}.",
)

ADVICE_QUESTIONS = (
    "How can I stay focused when working from home?",
    "What are some tips for a first job interview?",
    "How do I start running if I have never exercised before?",
    "How can I save money on groceries each month?",
    "What should I pack for a weekend camping trip?",
    "How do I politely say no when a coworker asks for too much help?",
    "How can I get better at remembering people's names?",
    "What are good ways to prepare for a public speaking event?",
    "How can I improve my sleep without medication?",
    "How do I start learning a new language as an adult?",
    "What is a good way to organize my week?",
    "How do I deal with a noisy neighbor calmly?",
    "How can I make my small apartment feel bigger?",
    "What should I consider before adopting a dog?",
    "How do I keep houseplants alive?",
    "How can I reduce my screen time?",
    "What are some easy ways to eat more vegetables?",
    "How do I ask my boss for a raise?",
    "How should I prepare for a long flight?",
    "How can I be a better listener?",
    "How can I make friends in a new city?",
    "What are some tips for studying for exams?",
    "How do I start a budget when I have never tracked my spending?",
    "How can I stop procrastinating on a big project?",
    "What should I do if I feel overwhelmed at work?",
    "How can I reduce food waste at home?",
    "How do I give constructive feedback to a teammate?",
    "What are some good habits for a productive morning?",
    "How can I prepare my home for a heat wave?",
    "How do I choose a good laptop for university?",
    "How do I write a good cover letter?",
    "What questions should I ask at the end of a job interview?",
    "How can I make a long car trip with kids easier?",
    "How can I keep my passwords safe?",
    "How do I recognize a phishing email?",
    "How do I start journaling and keep the habit?",
    "How can I become more confident when speaking in meetings?",
    "What are some ways to relax after a stressful day?",
    "How do I plan a small birthday party on a budget?",
    "How can I improve my handwriting?",
    "What should I do the week before moving house?",
    "How do I apologize sincerely after an argument with a friend?",
    "How can I teach my kids to save money?",
    "How can I make my resume stand out?",
    "How do I care for a cast-iron pan?",
    "How can I keep my energy up during the afternoon?",
    "What are the first steps to learning to code?",
    "How should I prepare for a job that involves a lot of travel?",
    "How can I get better at cooking without following recipes exactly?",
    "How do I keep in touch with friends who live far away?",
    "What should I think about before quitting my job?",
    "How can I make my commute more enjoyable?",
    "How do I choose a good book for a long vacation?",
    "How can I help a friend who is going through a hard time?",
    "How do I set boundaries with family members who visit too often?",
    "How can I stay motivated to learn something difficult?",
    "How do I make a good first impression at a new job?",
    "What are some tips for living with a roommate?",
    "How do I get started with gardening if I have no experience?",
    "How can I make my mornings less rushed?",
    "How should I prepare for a salary negotiation?",
    "What are some ways to spend less money on entertainment?",
    "How do I write a good thank-you note after an interview?",
    "How do I handle criticism at work without getting defensive?",
    "How can I make time for exercise with a busy schedule?",
    "What should I do if I lock myself out of my house?",
    "How do I choose a running shoe?",
    "How can I feel less anxious before a doctor's appointment?",
)

# (count, thing) pairs for "List ..." requests.
LIST_REQUESTS = (
    (5, "ideas for a rainy-day activity with kids"),
    (7, "healthy snacks that need no cooking"),
    (10, "names for a small bakery"),
    (5, "questions to ask a landlord before signing a lease"),
    (6, "ways to be more environmentally friendly at home"),
    (5, "books that are good for a beginner who wants to read more"),
    (8, "fun team-building activities for a remote team"),
    (5, "simple dinners that take less than 20 minutes"),
    (10, "conversation starters for a networking event"),
    (5, "things to check before buying a used car"),
    (7, "low-cost date ideas"),
    (5, "tips for writing clear emails"),
    (6, "indoor plants that are hard to kill"),
    (5, "ways to make a long meeting more productive"),
    (8, "items for a basic first aid kit"),
    (5, "habits that help with focus"),
    (10, "words to describe a sunset"),
    (5, "stretches for people who sit all day"),
    (6, "gift ideas for a coworker under 20 dollars"),
    (5, "things to do on a layover in a new city"),
    (7, "ways to practice gratitude"),
    (5, "reasons to learn a second language"),
    (8, "items to pack for a beach day"),
    (5, "common mistakes new managers make"),
    (6, "questions to ask when interviewing a job candidate"),
    (5, "ideas for a school science fair project"),
    (10, "animals that live in the Arctic"),
    (5, "ways to keep a conversation going"),
    (7, "easy breakfast ideas for busy mornings"),
    (5, "signs that you need a break from work"),
    (6, "board games for a family game night"),
    (5, "ways to make a presentation more engaging"),
    (8, "things to include in a travel checklist"),
    (5, "ideas for a neighborhood clean-up day"),
    (5, "tips for taking better photos with a phone"),
    (6, "topics for a beginner blog"),
    (5, "ways to welcome a new coworker"),
    (7, "hobbies that can be done at home"),
    (5, "tips for keeping a tidy kitchen"),
    (10, "names for a pet goldfish"),
    (5, "ideas for a themed dinner party"),
    (5, "questions to reflect on at the end of the year"),
    (6, "ways to save electricity in winter"),
)

LIST_TEMPLATES = (
    "List {count} {thing}.",
    "Give me {count} {thing}.",
    "Can you suggest {count} {thing}?",
)

# Short paragraphs written for this file, to be summarized by the model.
PARAGRAPHS_TO_SUMMARIZE = (
    "The town council met on Tuesday to discuss the new bike lanes. Supporters said the lanes would make cycling safer and reduce traffic. Some shop owners worried that removing parking spaces would hurt business. The council agreed to test the lanes on one street for six months before deciding.",
    "Maria started baking bread during a long winter. At first her loaves were flat and dense, but she kept notes on every attempt. After two months she learned that her kitchen was too cold for the dough to rise. Now she lets it rest near the oven and sells bread at the weekend market.",
    "Our team finished the mobile app two weeks late. The delay came from a payment feature that needed extra security testing. Users have given the app good reviews so far, especially for its simple design. Next quarter we plan to add offline support and fix the slow search screen.",
    "Honeybees communicate through a movement called the waggle dance. A bee that finds flowers returns to the hive and moves in a figure-eight pattern. The angle of the dance shows the direction of the food, and its length shows the distance. Other bees watch and then fly off to find it.",
    "The library will close for renovations from June to August. During that time, books can be borrowed from the community center on Main Street. Online services, such as e-books and audiobooks, will stay available. The renovated library will have a larger children's area and more study rooms.",
    "Many people think that multitasking makes them more productive. Research suggests the opposite: switching between tasks costs time and attention. Each switch forces the brain to refocus, and mistakes become more common. Working on one task at a time, with short breaks, usually gets more done.",
    "A small company in the village turned an old factory into a solar-powered workshop. It repairs bicycles and teaches teenagers basic mechanics. The project started with two volunteers and now employs six people. The owners hope to open a second workshop in the next town.",
    "The museum's new exhibition shows everyday objects from one hundred years ago. Visitors can see kitchen tools, school books and toys, and compare them with modern versions. A popular section lets children try old typewriters. The exhibition runs until the end of the year and entry is free on Sundays.",
    "Last year the city planted ten thousand trees along its busiest streets. Early measurements show that summer temperatures on those streets have dropped by almost two degrees. Residents also report less noise. The city plans to plant another five thousand trees, focusing on neighborhoods with few parks.",
    "Remote work has changed how many companies hire. Instead of looking only for people who live nearby, they can hire from anywhere. This gives workers more choice but also more competition. Some companies now pay different salaries depending on where employees live, which has caused debate.",
    "Sleep plays an important role in memory. During deep sleep, the brain replays what it learned during the day and stores it more firmly. Students who sleep well after studying often remember more than those who stay up late. Even a short nap can help the brain organize new information.",
    "The hiking club's trip to the lake was cancelled because of a storm warning. Members who paid for the bus will get a full refund by next Friday. The club is looking for a new date in October. Anyone who wants to help plan the trip can join the online meeting on Monday evening.",
    "Plastic waste in the ocean breaks into tiny pieces called microplastics. These pieces are eaten by fish and other sea animals and can enter the food chain. Scientists are still studying the effects on human health. Reducing single-use plastics is one of the simplest ways to limit the problem.",
    "The school introduced a four-day week for a trial term. Teachers used the fifth day for planning and training, and students had extra time for clubs and projects. Attendance improved slightly, but some parents struggled to arrange childcare. The school board will review the results in spring.",
    "Ancient sailors navigated using the stars. By measuring the angle of certain stars above the horizon, they could estimate how far north or south they were. Finding longitude was much harder and was only solved reliably in the eighteenth century with accurate clocks that worked at sea.",
    "Our customer survey had over two thousand responses. Most customers liked the fast delivery and friendly support. The most common complaint was confusing packaging instructions. Several people also asked for a cheaper subscription option. The product team will redesign the instructions first.",
    "Volcanic soil is often very fertile because it is rich in minerals. That is why farmers have lived near active volcanoes for thousands of years, despite the danger. Modern monitoring stations now measure small earthquakes and gas levels, giving people more warning before an eruption.",
    "The startup built a tool that helps small farms track water use. Sensors in the fields send data to a phone app, which suggests when to water. Farms that tested the tool used about twenty percent less water. The company now needs funding to make the sensors cheaper.",
    "Learning to play a musical instrument as an adult is slower than as a child, but it has real benefits. Adults can practice with more discipline and understand music theory more easily. Studies link regular practice to better memory and lower stress, whatever the starting age.",
    "The new train line connects the airport to the city center in twenty minutes. Before, the same trip took almost an hour by bus. Tickets cost a little more than the bus, but trains run every ten minutes. Local businesses near the stations expect more visitors.",
    "Composting turns food scraps and garden waste into rich soil. Microorganisms break down the material, which needs air, moisture and a mix of green and brown waste. A well-managed compost pile does not smell bad. After a few months, the compost can be used to feed plants.",
    "The company will switch to a new email system next month. All messages and contacts will be moved automatically over the weekend of the 14th. Staff should log out on Friday evening and log in with their usual password on Monday. The help desk will be open longer that week.",
    "The bakery on the corner has started a pay-what-you-can day every Wednesday. Customers pay whatever they think is fair, and the owner says most people pay close to the normal price. Some pay more to help neighbors who are struggling. The bakery will keep the scheme going through the winter.",
    "Electric scooters became popular in the city last summer. They are cheap and convenient for short trips, but many were left blocking sidewalks. The city now requires riders to park them in marked zones and fines the rental companies when scooters are left elsewhere.",
    "A recent study followed two thousand adults for ten years. People who walked at least thirty minutes a day had fewer heart problems than those who rarely exercised. The researchers say the walking does not need to be fast; regular movement matters more than intensity.",
    "Our neighborhood choir is looking for new members. No experience is needed, and rehearsals are on Thursday evenings at the community hall. The choir sings a mix of folk songs and pop music and performs twice a year. The first two rehearsals are free for newcomers.",
    "Octopuses are known for their intelligence. They can open jars, escape from tanks and recognize individual people. Each arm has many nerve cells, so the arms can react partly on their own. Scientists study octopuses to learn how very different brains can solve similar problems.",
    "The software update will change how files are shared. Instead of sending attachments, users will share links that can be set to expire. Administrators can see who opened each file. The update will be rolled out to small teams first, and feedback will be collected for two weeks.",
)

SUMMARY_TEMPLATES = (
    "Summarize this paragraph in one sentence:\n\n{paragraph}",
    "List the main points of this paragraph as short bullets:\n\n{paragraph}",
)

TRIVIA_QUESTIONS = (
    "What is the capital of Australia?",
    "Which planet is known as the Red Planet?",
    "How many continents are there, and what are they?",
    "Who painted the Mona Lisa?",
    "What is the largest ocean on Earth?",
    "How many bones are in the adult human body?",
    "What is the tallest mountain in the world?",
    "Which gas do plants absorb from the air?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level in Celsius?",
    "What is the longest river in Africa?",
    "Which animal is the largest mammal?",
    "What language has the most native speakers?",
    "In which year did humans first land on the Moon?",
    "What is the chemical symbol for gold?",
    "How many players are on a soccer team on the field?",
    "What is the smallest prime number?",
    "Which country is home to the kangaroo?",
    "What is the hardest natural substance?",
    "Who developed the theory of relativity?",
    "What is the capital of Canada?",
    "How many days does it take the Earth to orbit the Sun?",
    "What is the main ingredient in guacamole?",
    "Which instrument has 88 keys?",
    "What is the freezing point of water in Fahrenheit?",
    "Which planet has the most moons known so far?",
    "What is the largest desert in the world?",
    "Who was the first person to reach the South Pole?",
    "How many sides does a hexagon have?",
    "What is the currency of Japan?",
    "Which organ pumps blood through the body?",
    "What is the capital of Brazil?",
    "Which ocean lies between Africa and Australia?",
    "What is the square root of 144?",
    "Who invented the telephone, according to most history books?",
    "Which element has the atomic number 1?",
    "What is the official language of Brazil?",
    "How many hours are in a week?",
    "What is the largest planet in our solar system?",
    "Which country gave the Statue of Liberty to the United States?",
    "What do bees collect from flowers to make honey?",
    "Which is the smallest country in the world by area?",
    "What is the name of the galaxy we live in?",
    "How many strings does a standard guitar have?",
    "What is the capital of Kenya?",
    "Which famous scientist proposed the laws of motion?",
    "What is the most spoken language in South America?",
    "How many minutes are in a day?",
    "What is the name of the longest bone in the human body?",
    "Which metal is liquid at room temperature?",
    "What is the capital of Egypt?",
    "Which country has the largest population in Africa?",
    "What do you call a baby kangaroo?",
    "Which colors are on the flag of Italy?",
    "What is the main language spoken in Mexico?",
    "Which planet is closest to the Sun?",
    "How many legs does a spider have?",
    "What is the capital of South Korea?",
    "Which sport is played at Wimbledon?",
    "What is the largest country in the world by area?",
    "How many zeros are in one million?",
    "What is the name of the fairy tale character who leaves a glass slipper at a ball?",
    "Which bird is a symbol of peace?",
    "What is the capital of Norway?",
    "Which vitamin does the body make when skin is exposed to sunlight?",
    "What is the capital of Spain?",
    "How many planets are in our solar system?",
    "What is the capital of Portugal?",
    "Which country is famous for inventing pizza?",
    "What is the fastest land animal?",
    "How many centimetres are in a metre?",
    "What is the capital of Argentina?",
    "Which language is spoken in Quebec besides English?",
    "Who wrote the novel Pride and Prejudice?",
    "What is the chemical formula for water?",
    "Which continent is Egypt in?",
    "What is the largest island in the world?",
    "How many weeks are in a year?",
    "What is the name of the force that keeps us on the ground?",
    "Which planet has the famous rings that are easiest to see?",
    "What do caterpillars turn into?",
    "What is the primary language of Australia?",
    "What is the capital of Thailand?",
    "Which month has the fewest days?",
    "What is the tallest animal on Earth?",
    "What is the name of the process by which water turns into vapor?",
    "Which ocean is the Bermuda Triangle in?",
    "Who was the first woman to win a Nobel Prize?",
    "What is the capital of New Zealand?",
)

TRIVIA_TEMPLATES = (
    "{question}",
    "Quick question: {question}",
    "{question} Answer in one or two sentences.",
)

# Blunt sentences to be rewritten more politely.
BLUNT_SENTENCES = (
    "Send me the report now.",
    "Your code is wrong, fix it.",
    "I don't have time for this meeting.",
    "Stop calling me after 8 PM.",
    "You forgot to reply to my email again.",
    "This design is ugly.",
    "Move your car, it's blocking my driveway.",
    "I need the money you owe me by Friday.",
    "Your presentation was too long.",
    "Turn the music down.",
    "Why is this taking so long?",
    "I won't be able to come, don't count on me.",
    "You're late again.",
    "That idea will never work.",
    "Clean the kitchen after you use it.",
    "Answer my question.",
    "We are not giving refunds.",
    "Your application was rejected.",
    "I told you this already.",
    "Don't touch my things.",
    "The food was cold and the service was slow.",
    "You need to work harder.",
    "Give me a discount or I'm leaving.",
    "Read the instructions before asking me.",
    "This is not my job.",
    "Your dog keeps barking all night.",
    "We're cancelling your order.",
    "Tell me what you want, I'm busy.",
    "Your invoice has the wrong amount.",
    "I'm not going to redo the whole thing.",
    "You never clean up after the meeting.",
    "Your email was confusing.",
    "Stop interrupting me.",
    "I need an answer today.",
    "You parked in my spot.",
    "This is the third time I'm asking.",
    "Your prices are too high.",
    "I can't read your handwriting.",
)

POLITE_REWRITE_TEMPLATES = (
    "Rewrite this sentence to sound more polite: \"{sentence}\"",
    "Make this message friendlier but keep the meaning: \"{sentence}\"",
)

# Sentences with grammar or spelling mistakes, written for this file.
SENTENCES_WITH_ERRORS = (
    "Me and him goes to the store yesterday.",
    "Their going to be late because of there car.",
    "She don't like coffee in the morning.",
    "I have went to Paris three times.",
    "The list of items are on the table.",
    "Can you borrow me your pen?",
    "Each of the students have a book.",
    "I should of studied harder for the test.",
    "The team are playing good this season.",
    "Between you and I, the plan is risky.",
    "Who's book is this?",
    "We was waiting for hours.",
    "He runned to the bus stop.",
    "Less people came to the event than last year.",
    "The childrens are playing outside.",
    "I seen that movie last week.",
    "If I was you, I would apologize.",
    "Its a beautiful day, isnt it.",
    "She is more taller than her brother.",
    "The informations you sent was helpful.",
    "Neither the manager nor the employees was informed.",
    "I am agree with your opinion.",
    "He has lived here since five years.",
    "The dog wagged it's tail.",
    "Your the best friend I ever had.",
    "Me and my sister likes to swim.",
    "There is many reasons to learn coding.",
    "He don't know nothing about cars.",
    "I could care less about the weather.",
    "We goes to the park every sunday.",
    "The book was wrote by a famous author.",
    "I am looking forward to meet you.",
    "She has less friends than her brother.",
)

GRAMMAR_FIX_TEMPLATES = (
    "Fix the grammar in this sentence: \"{sentence}\"",
    "Correct the mistakes in this sentence and explain what was wrong: \"{sentence}\"",
)

CREATIVE_TOPICS = (
    "the first snow of winter", "a cat watching the rain", "a lighthouse at night",
    "a busy train station", "an old oak tree", "the smell of fresh bread",
    "a robot learning to paint", "the last day of summer", "a city waking up",
    "a lost umbrella", "the ocean at dawn", "a grandmother's kitchen",
    "a seed growing into a flower", "a quiet library", "a thunderstorm",
    "a dog waiting at the door", "the Moon", "a long road trip",
    "moving to a new home", "friendship", "a mountain lake",
    "the sound of a violin", "a market on a Saturday morning", "autumn leaves",
    "a child's first day of school", "a spaceship leaving Earth", "a forgotten letter",
    "coffee on a Monday morning", "a garden after rain", "a shooting star",
)

CREATIVE_TEMPLATES = (
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a two-sentence story about {topic}.",
    "Write a short, cheerful paragraph describing {topic}.",
)

PLANNING_REQUESTS = (
    "Help me plan a three-day trip to Rome on a modest budget.",
    "Create a simple weekly meal plan for a vegetarian family of four.",
    "Make a beginner's three-day-a-week workout plan that needs no equipment.",
    "Help me plan a surprise birthday party for my partner.",
    "Create a study schedule for the two weeks before my final exams.",
    "Give me a packing list for a one-week business trip.",
    "Plan a relaxing Sunday for someone who feels burned out.",
    "Help me create a morning routine that takes 30 minutes.",
    "Make a checklist for moving into a new apartment.",
    "Plan a simple picnic menu for six people.",
    "Help me organize a garage sale this weekend.",
    "Create a 30-day plan to read more books.",
    "Plan a kid-friendly day out in a big city.",
    "Help me plan a small garden for a sunny balcony.",
    "Create a cleaning schedule for a shared apartment.",
    "Help me prepare an agenda for a one-hour team meeting.",
    "Make a plan to learn basic Spanish in three months.",
    "Plan a budget-friendly wedding anniversary dinner at home.",
    "Create a simple savings plan to buy a 1,000 dollar laptop in six months.",
    "Help me plan the first week at a new job.",
    "Plan a weekend hiking trip for beginners.",
    "Create a daily schedule for working from home with two young children.",
    "Help me plan a book club's first meeting.",
    "Plan a holiday gift list for ten people with a 300 dollar budget.",
    "Create a simple plan for decluttering my home in one month.",
    "Help me plan a rainy-day itinerary for visiting London.",
    "Plan a fundraising bake sale for a school.",
    "Create a one-week plan to get back into a regular sleep schedule.",
)

NAMING_REQUESTS = (
    "Suggest five names for a coffee shop that also sells books.",
    "Suggest a catchy name for a podcast about personal finance.",
    "Suggest names for a gray kitten with white paws.",
    "Suggest five names for a running club.",
    "Suggest a name and slogan for a small cleaning business.",
    "Suggest three titles for a blog post about learning to cook.",
    "Suggest names for a family board game night tradition.",
    "Suggest five names for a productivity app.",
    "Suggest a short motto for a school robotics team.",
    "Suggest names for a community garden.",
    "Suggest a title for a short story about a time-traveling librarian.",
    "Suggest five names for a food truck that sells tacos.",
    "Suggest a friendly name for a customer support chatbot.",
    "Suggest names for a newsletter about gardening.",
    "Suggest three names for a charity run that raises money for a hospital.",
    "Suggest a name for a houseplant shop.",
)

GENERAL_ASSISTANT_REQUESTS = (
    "Write a short toast for my best friend's wedding.",
    "Write a short bio for my profile on a professional networking site. I am a nurse who loves hiking.",
    "Write a thank-you note to a teacher at the end of the school year.",
    "Write a short product description for a reusable water bottle.",
    "Write an out-of-office reply for a two-week vacation.",
    "Write a short speech to welcome guests to a charity dinner.",
    "Write a friendly reminder for a shared fridge asking people to label their food.",
    "Write a short announcement that our office will be closed on Monday.",
    "Write a short apology to customers for a website outage.",
    "Write a short introduction I can use at the start of a team meeting.",
    "Write a polite note asking guests to take their shoes off.",
    "Write a short review of a cozy neighborhood cafe.",
    "Write a short message for a farewell card for a coworker.",
    "Write a short description for a lost cat poster.",
    "Write a job posting for a part-time bakery assistant.",
    "Write a short welcome message for new members of an online forum.",
    "Tell me a clean joke about computers.",
    "Tell me a fun fact about octopuses.",
    "Tell me an interesting fact about the history of chocolate.",
    "Recommend a good way to spend a free afternoon in a new city.",
    "Describe a perfect summer day in three sentences.",
    "Give me a motivational quote and explain what it means.",
    "Explain the rules of tic-tac-toe.",
    "What are some good questions to ask on a first date?",
    "What should I name my new sourdough starter?",
    "Give me a simple recipe for pancakes.",
    "Give me a simple recipe for tomato soup.",
    "How do I make a good cup of tea?",
    "What can I cook with eggs, spinach and cheese?",
    "Give me a riddle and its answer.",
    "Pretend you are a tour guide and describe the Eiffel Tower in a few sentences.",
    "Write a short pep talk for someone starting a new job tomorrow.",
    "Help me write a short message declining a party invitation politely.",
    "Help me write a short note to put in a birthday present for my dad.",
    "I feel nervous about my exam tomorrow. Can you give me some encouragement?",
    "I just moved to a new city and feel a bit lonely. Any suggestions?",
    "Can you help me decide between a cat and a dog as a first pet?",
    "I have 20 minutes and no plans. What could I do?",
    "What is a good way to start a conversation with a new neighbor?",
    "Give me three tips for writing a birthday card message.",
    "Write a short invitation for a neighborhood barbecue on Saturday.",
    "Write a short note to my future self to open in five years.",
    "Write a two-line rhyme for a graduation card.",
    "Write a short caption for a photo of a sunset at the beach.",
    "Write a short social media post announcing our shop's new opening hours.",
    "Write a short, kind message to a coworker who is retiring.",
    "Give me a simple recipe for a fruit smoothie.",
    "Give me a simple recipe for vegetable fried rice.",
    "What can I make for dinner with pasta, garlic and a can of tomatoes?",
    "Tell me a fun fact about the ocean.",
    "Tell me a short, funny story about a cat who wants to be a chef.",
    "Recommend a few relaxing activities for a Sunday evening.",
    "Describe the taste of a lemon to someone who has never tried one.",
    "Help me write a short message asking a friend to return a book.",
    "Help me write a polite reminder to a friend about money they owe me.",
    "I want to surprise my mom on Mother's Day. Any ideas?",
    "Can you explain the rules of chess in a few sentences?",
    "What is a good way to remember my grocery list?",
    "Write a short note to welcome guests staying in my spare room.",
    "Give me a short tongue twister.",
)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def normalize_for_dedup(prompt: str) -> str:
    """Key under which two prompts count as the same (spacing and case ignored)."""
    return " ".join(prompt.split()).casefold()


def unique_in_order(prompts: Iterable[str]) -> list[str]:
    """Drop repeated prompts, keeping the first occurrence."""
    seen: dict[str, None] = {}
    kept = []
    for prompt in prompts:
        key = normalize_for_dedup(prompt)
        if key not in seen:
            seen[key] = None
            kept.append(prompt)
    return kept


def rotate(templates: tuple[str, ...], index: int) -> str:
    """Pick a template by position so phrasings are spread evenly."""
    return templates[index % len(templates)]


def code_block(language: str, code: str) -> str:
    """Fence a snippet the way a user would paste it into a chat."""
    fence_language = {"JavaScript": "javascript", "SQL": "sql", "bash": "bash", "C": "c"}.get(
        language, "python"
    )
    return f"```{fence_language}\n{code}\n```"


# The general tasks are phrased with Python's container names; JavaScript
# users would say "array" and "object".
JAVASCRIPT_TERM_REPLACEMENTS = (
    (re.compile(r"\blists\b"), "arrays"),
    (re.compile(r"\ba list\b"), "an array"),
    (re.compile(r"\blist\b"), "array"),
    (re.compile(r"\bdictionaries\b"), "objects"),
    (re.compile(r"\ba dictionary\b"), "an object"),
    (re.compile(r"\bdictionary\b"), "object"),
)


def in_javascript_terms(task: str) -> str:
    for pattern, replacement in JAVASCRIPT_TERM_REPLACEMENTS:
        task = pattern.sub(replacement, task)
    return task


def mentions_validation_topic(prompt: str) -> bool:
    return any(pattern.search(prompt) for pattern in VALIDATION_TOPIC_PATTERNS)


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def quantity(amount: float, unit: str) -> str:
    """'1 hour', '2 hours', '0.5 hours': keeps generated questions grammatical."""
    return f"{amount:g} {unit}" if amount == 1 else f"{amount:g} {unit}s"


def duration(hours: int, minutes: int) -> str:
    """'50 minutes', '1 hour', '2 hours and 5 minutes'."""
    parts = [quantity(value, unit) for value, unit in ((hours, "hour"), (minutes, "minute")) if value]
    return " and ".join(parts)


def seeded_rng(label: str) -> random.Random:
    """A generator per use, derived from BASE_SEED and a stable label.

    The label goes through CRC-32 rather than hash(): string hashes are
    randomized per process, CRC-32 is the same everywhere.
    """
    return random.Random(BASE_SEED * 2**32 + zlib.crc32(label.encode("utf-8")))


# ---------------------------------------------------------------------------
# Coding prompts
# ---------------------------------------------------------------------------


def python_function_prompts() -> Iterator[str]:
    for index, task in enumerate(GENERAL_FUNCTION_TASKS):
        yield rotate(PYTHON_FUNCTION_TEMPLATES, index).format(task=task)


def javascript_prompts() -> Iterator[str]:
    reused_tasks = GENERAL_FUNCTION_TASKS[::JAVASCRIPT_REUSE_STEP]
    for index, task in enumerate(reused_tasks):
        yield rotate(JAVASCRIPT_FUNCTION_TEMPLATES, index).format(task=in_javascript_terms(task))
    yield from JAVASCRIPT_SPECIFIC_PROMPTS


def unit_test_prompts() -> Iterator[str]:
    # Offset by 2 so these tasks are mostly not the ones reused for JavaScript.
    tested_tasks = GENERAL_FUNCTION_TASKS[2::TEST_PROMPT_STEP]
    for index, task in enumerate(tested_tasks):
        yield rotate(UNIT_TEST_TEMPLATES, index).format(task=task)


def sql_prompts() -> Iterator[str]:
    for index, (schema, task) in enumerate(SQL_TASKS):
        yield rotate(SQL_TEMPLATES, index).format(schema=schema, task=task)
    yield from SQL_GENERAL_PROMPTS


def shell_prompts() -> Iterator[str]:
    for index, task in enumerate(BASH_TASKS):
        yield rotate(BASH_TEMPLATES, index).format(task=task)


def c_prompts() -> Iterator[str]:
    for index, task in enumerate(C_TASKS):
        yield rotate(C_TEMPLATES, index).format(task=task)
    yield from C_GENERAL_PROMPTS


def python_class_prompts() -> Iterator[str]:
    for index, (name, behaviour) in enumerate(PYTHON_CLASS_TASKS):
        yield rotate(PYTHON_CLASS_TEMPLATES, index).format(name=name, behaviour=behaviour)


def explain_code_prompts() -> Iterator[str]:
    for index, (language, code) in enumerate(CODE_SNIPPETS_TO_EXPLAIN):
        yield rotate(EXPLAIN_CODE_TEMPLATES, index).format(
            language=language, code=code_block(language, code)
        )


def fix_bug_prompts() -> Iterator[str]:
    for index, (language, code, hint) in enumerate(BUGGY_SNIPPETS):
        yield rotate(FIX_BUG_TEMPLATES, index).format(
            language=language, hint=hint, code=code_block(language, code)
        )


def stdlib_prompts() -> Iterator[str]:
    # Two prompts per callable: one about using it in general, one about a
    # concrete purpose, so the target shows both reference-style answers and
    # small programs.
    for index, (name, purpose) in enumerate(STDLIB_CALLABLES):
        yield rotate(STDLIB_USAGE_TEMPLATES, index).format(name=name)
        yield rotate(STDLIB_PURPOSE_TEMPLATES, index).format(name=name, purpose=purpose)


CODING_SOURCES: tuple[Callable[[], Iterable[str]], ...] = (
    python_function_prompts,
    javascript_prompts,
    unit_test_prompts,
    sql_prompts,
    shell_prompts,
    c_prompts,
    python_class_prompts,
    explain_code_prompts,
    fix_bug_prompts,
    lambda: CODING_HOW_TO_QUESTIONS,
    stdlib_prompts,
)


def coding_training_prompts() -> list[str]:
    prompts = (prompt for source in CODING_SOURCES for prompt in source())
    return [prompt for prompt in unique_in_order(prompts) if not mentions_validation_topic(prompt)]


# ---------------------------------------------------------------------------
# Math prompts: one function per problem family, each taking its own RNG
# ---------------------------------------------------------------------------


def math_shopping_total(rng: random.Random) -> str:
    name = rng.choice(PERSON_NAMES)
    (item_a, low_a, high_a), (item_b, low_b, high_b) = rng.sample(SHOP_ITEMS, 2)
    count_a, count_b = rng.randint(2, 9), rng.randint(2, 9)
    # Prices in multiples of 5 cents look like real shop prices.
    price_a = rng.randrange(low_a, high_a + 1, 5)
    price_b = rng.randrange(low_b, high_b + 1, 5)
    question = (
        f"{name} buys {count_a} {item_a} at {money(price_a)} each and "
        f"{count_b} {item_b} at {money(price_b)} each."
    )
    total = count_a * price_a + count_b * price_b
    if rng.random() < 0.5:
        # Pay with the smallest common note that covers the bill.
        bill = next(note for note in (1000, 2000, 5000, 10000, 20000) if note > total)
        return f"{question} {name} pays with a {money(bill)[:-3]} bill. How much change does {name} get?"
    return f"{question} How much does {name} spend in total?"


def math_speed_distance_time(rng: random.Random) -> str:
    vehicle = rng.choice(("car", "train", "bus", "cyclist", "runner", "boat", "plane"))
    speed_range = {
        "car": (40, 120), "train": (60, 200), "bus": (30, 80), "cyclist": (12, 30),
        "runner": (8, 16), "boat": (10, 40), "plane": (500, 900),
    }[vehicle]
    speed = rng.randrange(speed_range[0], speed_range[1] + 1, 2 if speed_range[1] < 100 else 10)
    quarter_hours = rng.randint(2, 20)
    hours_text = quantity(quarter_hours / 4, "hour")
    distance = speed * quarter_hours / 4
    distance_text = f"{distance:g}"
    article = "an" if vehicle[0] in "aeiou" else "a"
    variant = rng.randrange(3)
    if variant == 0:
        return f"A {vehicle} travels at {speed} km/h for {hours_text}. How far does it go?"
    if variant == 1:
        return f"{article.capitalize()} {vehicle} covers {distance_text} km in {hours_text}. What is its average speed?"
    return f"{article.capitalize()} {vehicle} needs to cover {distance_text} km at a steady {speed} km/h. How long does the trip take, in hours and minutes?"


def math_percentages(rng: random.Random) -> str:
    variant = rng.randrange(4)
    if variant == 0:
        percent = rng.choice((5, 10, 12, 15, 20, 25, 30, 35, 40, 45, 60, 75, 80))
        base = rng.randrange(20, 2001, 20)
        return f"What is {percent}% of {base}?"
    if variant == 1:
        item = rng.choice(("jacket", "laptop", "pair of shoes", "bicycle", "sofa", "backpack", "coffee machine"))
        price = rng.randrange(20, 901, 5)
        percent = rng.choice((10, 15, 20, 25, 30, 40, 50))
        return f"A {item} costs ${price} and is on sale for {percent}% off. What is the sale price?"
    if variant == 2:
        start = rng.randrange(1000, 50001, 500)
        percent = rng.choice((2, 4, 5, 8, 10, 12, 20, 25))
        end = start * (100 + percent) // 100
        subject = rng.choice(("A town's population", "A website's monthly visitors", "A shop's yearly sales in dollars"))
        return f"{subject} grew from {start:,} to {end:,}. What was the percentage increase?"
    whole = rng.randrange(20, 401, 10)
    part = whole * rng.choice((5, 10, 15, 20, 25, 30, 40, 45, 60, 75, 80, 90)) // 100
    return f"{part} is what percent of {whole}?"


def math_ages(rng: random.Random) -> str:
    older, younger = rng.sample(PERSON_NAMES, 2)
    if rng.random() < 0.5:
        younger_age = rng.randint(3, 40)
        gap = rng.randint(2, 30)
        total = 2 * younger_age + gap
        return (
            f"{older} is {gap} years older than {younger}. The sum of their ages is {total}. "
            f"How old is each of them?"
        )
    # "A is m times as old as B; in y years A will be k times as old."
    # Pick values that give whole-number answers.
    while True:
        younger_age = rng.randint(2, 15)
        multiple = rng.randint(3, 5)
        options = [
            years for years in range(1, 31)
            if (multiple * younger_age + years) % (younger_age + years) == 0
            and (multiple * younger_age + years) // (younger_age + years) >= 2
        ]
        if options:
            years = rng.choice(options)
            later_multiple = (multiple * younger_age + years) // (younger_age + years)
            break
    later_word = {2: "twice", 3: "three times", 4: "four times"}[later_multiple]
    return (
        f"{older} is {multiple} times as old as {younger}. In {years} years, {older} will be "
        f"{later_word} as old as {younger}. How old are they now?"
    )


def math_fractions(rng: random.Random) -> str:
    def fraction() -> str:
        denominator = rng.randint(2, 12)
        return f"{rng.randint(1, denominator - 1)}/{denominator}"

    variant = rng.randrange(5)
    if variant == 0:
        return f"What is {fraction()} + {fraction()}? Simplify the result."
    if variant == 1:
        return f"Subtract {fraction()} from {rng.randint(1, 3)} {fraction()}. Give the answer as a mixed number."
    if variant == 2:
        return f"What is {fraction()} multiplied by {fraction()}?"
    if variant == 3:
        return f"What is {fraction()} divided by {fraction()}? Simplify the result."
    factor = rng.randint(2, 9)
    numerator = rng.randint(1, 9)
    denominator = rng.randint(numerator + 1, 12)
    return f"Simplify the fraction {numerator * factor}/{denominator * factor}, then write it as a decimal."


def math_areas(rng: random.Random) -> str:
    variant = rng.randrange(6)
    if variant == 0:
        width, length = rng.randint(2, 15), rng.randint(3, 20)
        return f"A room is {width} m wide and {length} m long. What is its floor area, and how long is its perimeter?"
    if variant == 1:
        base, height = rng.randint(3, 30), rng.randint(2, 25)
        return f"A triangle has a base of {base} cm and a height of {height} cm. What is its area?"
    if variant == 2:
        radius = rng.randint(2, 20)
        return f"A circular garden has a radius of {radius} m. What is its area? Use pi = 3.14."
    if variant == 3:
        length, width, height = rng.randint(10, 60), rng.randint(10, 40), rng.randint(5, 30)
        return f"A box measures {length} cm by {width} cm by {height} cm. What is its volume in cubic centimetres?"
    if variant == 4:
        side = rng.randint(4, 40)
        price = rng.randint(3, 25)
        return f"A square field has sides of {side} m. Fencing costs ${price} per metre. How much does it cost to fence the whole field?"
    top, bottom, height = rng.randint(3, 12), rng.randint(13, 25), rng.randint(2, 15)
    return f"A trapezoid has parallel sides of {top} cm and {bottom} cm and a height of {height} cm. What is its area?"


def math_unit_conversion(rng: random.Random) -> str:
    variant = rng.randrange(7)
    if variant == 0:
        kilometres = rng.randint(1, 90) / 4
        return f"Convert {kilometres:g} kilometres to metres."
    if variant == 1:
        hours, minutes = rng.randint(1, 9), rng.randrange(5, 60, 5)
        return f"How many minutes are in {duration(hours, minutes)}?"
    if variant == 2:
        celsius = rng.randrange(-20, 41, 5)
        return f"Convert {celsius} degrees Celsius to Fahrenheit."
    if variant == 3:
        celsius = rng.randrange(-20, 101, 5)
        fahrenheit = celsius * 9 // 5 + 32
        return f"Convert {fahrenheit} degrees Fahrenheit to Celsius."
    if variant == 4:
        inches = rng.randint(2, 72)
        return f"How many centimetres are in {inches} inches, if 1 inch is 2.54 cm?"
    if variant == 5:
        grams = rng.randrange(50, 5001, 50)
        return f"A recipe needs {grams} grams of flour. How many kilograms is that?"
    seconds = rng.randint(70, 4000)
    return f"Convert {seconds} seconds into minutes and seconds."


def math_algebra(rng: random.Random) -> str:
    solution = rng.randint(-10, 15)
    variant = rng.randrange(4)
    if variant == 0:
        coefficient, constant = rng.randint(2, 9), rng.randint(1, 30)
        return f"Solve for x: {coefficient}x + {constant} = {coefficient * solution + constant}."
    if variant == 1:
        coefficient, constant = rng.randint(2, 9), rng.randint(1, 30)
        return f"Solve for x: {coefficient}x - {constant} = {coefficient * solution - constant}."
    if variant == 2:
        left, right = rng.sample(range(2, 10), 2)
        left_constant = rng.randint(-15, 15)
        right_constant = left * solution + left_constant - right * solution

        def signed(value: int) -> str:
            return f"+ {value}" if value >= 0 else f"- {-value}"

        return f"Solve for x: {left}x {signed(left_constant)} = {right}x {signed(right_constant)}."
    first, second = rng.randint(1, 30), rng.randint(1, 30)
    return f"Solve the system of equations: x + y = {first + second} and x - y = {first - second}."


def math_sequences(rng: random.Random) -> str:
    variant = rng.randrange(4)
    if variant == 0:
        start, step = rng.randint(-10, 30), rng.choice((2, 3, 4, 5, 6, 7, 9, 11, -3, -4))
        terms = ", ".join(str(start + step * i) for i in range(4))
        return f"What is the next number in the sequence {terms}, ...? What is the 20th term?"
    if variant == 1:
        start, ratio = rng.randint(1, 6), rng.choice((2, 3, 4, 5))
        terms = ", ".join(str(start * ratio**i) for i in range(4))
        return f"Find the next two numbers in the sequence {terms}, ... and describe the rule."
    if variant == 2:
        count = rng.randint(10, 200)
        return f"What is the sum of the first {count} positive whole numbers?"
    start, step, count = rng.randint(1, 20), rng.randint(2, 8), rng.randint(8, 40)
    return f"Find the sum of the arithmetic series that starts at {start}, increases by {step} each time and has {count} terms."


def math_arithmetic(rng: random.Random) -> str:
    variant = rng.randrange(4)
    if variant == 0:
        return f"What is {rng.randint(12, 999)} multiplied by {rng.randint(11, 99)}?"
    if variant == 1:
        divisor = rng.randint(3, 25)
        return f"Divide {rng.randint(200, 9999):,} by {divisor} and give the quotient and the remainder."
    if variant == 2:
        a, b, c = rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 12)
        d = rng.randint(1, 9)
        divisor = rng.choice((2, 3, 4, 5))
        e = divisor * rng.randint(1, 10)
        return f"Evaluate {a} + {b} * ({c} - {d}) - {e} / {divisor} using the correct order of operations."
    numbers = [rng.randint(100, 9999) for _ in range(rng.randint(3, 5))]
    return f"Add these numbers: {', '.join(f'{n:,}' for n in numbers)}."


def math_averages(rng: random.Random) -> str:
    name = rng.choice(PERSON_NAMES)
    if rng.random() < 0.5:
        scores = [rng.randint(55, 100) for _ in range(rng.randint(4, 7))]
        return f"{name}'s test scores are {', '.join(map(str, scores))}. What is the mean score? What is the median?"
    scores = [rng.randint(60, 95) for _ in range(4)]
    target = rng.randint(70, 90)
    return (
        f"{name} scored {', '.join(map(str, scores))} on four tests. What score does {name} need "
        f"on the fifth test to have an average of {target}? Is that possible if the maximum is 100?"
    )


def math_ratios(rng: random.Random) -> str:
    variant = rng.randrange(3)
    if variant == 0:
        servings, new_servings = rng.sample((2, 3, 4, 6, 8, 10, 12), 2)
        cups = rng.choice((1, 1.5, 2, 2.5, 3, 4))
        ingredient = rng.choice(("flour", "sugar", "milk", "rice", "oats"))
        return f"A recipe for {servings} servings uses {cups:g} cups of {ingredient}. How much {ingredient} is needed for {new_servings} servings?"
    if variant == 1:
        first, second = rng.sample(range(1, 8), 2)
        total = (first + second) * rng.randint(2, 12)
        return f"Paint is mixed from blue and yellow in the ratio {first}:{second}. How many litres of each are needed for {total} litres of paint?"
    people = rng.sample(PERSON_NAMES, 2)
    first, second = rng.sample(range(1, 6), 2)
    amount = (first + second) * rng.randrange(10, 201, 10)
    return f"{people[0]} and {people[1]} share ${amount} in the ratio {first}:{second}. How much does each person get?"


def math_interest(rng: random.Random) -> str:
    principal = rng.randrange(500, 20001, 500)
    rate = rng.choice((2, 3, 4, 5, 6, 7, 8))
    years = rng.randint(2, 10)
    if rng.random() < 0.5:
        return f"How much simple interest does ${principal:,} earn at {rate}% per year over {years} years?"
    return f"${principal:,} is invested at {rate}% interest compounded once a year. How much is it worth after {years} years?"


def math_time(rng: random.Random) -> str:
    half = rng.choice(("AM", "PM"))
    # Events in the small hours of the morning read oddly; start AM ones at 6.
    start_hour, start_minute = rng.randint(6 if half == "AM" else 1, 11), rng.randrange(0, 60, 5)
    duration_hours, duration_minutes = rng.randint(0, 4), rng.randrange(5, 60, 5)
    event = rng.choice(("A movie", "A train journey", "A concert", "A football match", "A workshop", "A flight"))
    if rng.random() < 0.5:
        return (
            f"{event} starts at {start_hour}:{start_minute:02d} {half} and lasts "
            f"{duration(duration_hours, duration_minutes)}. At what time does it end?"
        )
    end_hour, end_minute = rng.randint(1, 11), rng.randrange(0, 60, 5)
    return (
        f"How many hours and minutes are there between {start_hour}:{start_minute:02d} AM "
        f"and {end_hour}:{end_minute:02d} PM on the same day?"
    )


def math_probability(rng: random.Random) -> str:
    variant = rng.randrange(3)
    if variant == 0:
        red, blue, green = rng.randint(1, 12), rng.randint(1, 12), rng.randint(0, 8)
        bag = f"{red} red, {blue} blue and {green} green marbles" if green else f"{red} red and {blue} blue marbles"
        return f"A bag contains {bag}. If you pick one marble at random, what is the probability that it is blue?"
    if variant == 1:
        total = rng.randint(2, 12)
        return f"Two fair six-sided dice are rolled. What is the probability that the sum is {total}?"
    flips = rng.randint(3, 6)
    heads = rng.randint(0, flips)
    return f"A fair coin is flipped {flips} times. What is the probability of getting exactly {heads} heads?"


def math_work_and_rates(rng: random.Random) -> str:
    variant = rng.randrange(3)
    if variant == 0:
        workers = rng.randint(2, 8)
        days = rng.randint(2, 12)
        # Only crew sizes that finish in a whole number of days; 1 always qualifies.
        crew_sizes = [n for n in range(1, 25) if (workers * days) % n == 0 and n != workers]
        new_workers = rng.choice(crew_sizes)
        return (
            f"{workers} painters can paint a school in {days} days. How long would "
            f"{quantity(new_workers, 'painter')} take, working at the same rate?"
        )
    if variant == 1:
        rate = rng.randint(12, 240)
        hours, minutes = rng.randint(1, 8), rng.choice((0, 15, 30, 45))
        return f"A machine makes {rate} parts per hour. How many parts does it make in {duration(hours, minutes)}?"
    name = rng.choice(PERSON_NAMES)
    wage = rng.randint(12, 40)
    hours = rng.randint(10, 45)
    return f"{name} earns ${wage} per hour and works {hours} hours a week. How much does {name} earn in 4 weeks, and in a year of 52 weeks?"


# (family label, generator) pairs; the label seeds the family's RNG.
# Percentages and linear equations are listed twice (with different seeds)
# because they are the most common school and everyday problems.
MATH_FAMILIES: tuple[tuple[str, Callable[[random.Random], str]], ...] = (
    ("shopping", math_shopping_total),
    ("speed", math_speed_distance_time),
    ("percent", math_percentages),
    ("ages", math_ages),
    ("fractions", math_fractions),
    ("areas", math_areas),
    ("units", math_unit_conversion),
    ("algebra", math_algebra),
    ("sequences", math_sequences),
    ("arithmetic", math_arithmetic),
    ("averages", math_averages),
    ("ratios", math_ratios),
    ("interest", math_interest),
    ("time", math_time),
    ("probability", math_probability),
    ("rates", math_work_and_rates),
    ("percent-2", math_percentages),
    ("algebra-2", math_algebra),
)


def math_prompts() -> list[str]:
    prompts: list[str] = []
    for label, make_question in MATH_FAMILIES:
        rng = seeded_rng(f"math:{label}")
        family: dict[str, None] = {}
        attempts = 0
        while len(family) < MATH_PROMPTS_PER_FAMILY:
            attempts += 1
            if attempts > MATH_PROMPTS_PER_FAMILY * 100:
                raise RuntimeError(f"math family {label!r} cannot produce enough unique questions")
            # The suffix is drawn after the question, from the same RNG, so the
            # request for a step-by-step answer is phrased several ways.
            question = make_question(rng)
            prompt = f"{question} {rng.choice(MATH_STEP_SUFFIXES)}"
            family.setdefault(prompt, None)
        prompts.extend(family)
    return unique_in_order(prompts)


# ---------------------------------------------------------------------------
# Explain prompts
# ---------------------------------------------------------------------------


def explain_prompts() -> list[str]:
    prompts: list[str] = []
    for index, concept in enumerate(EXPLAIN_CONCEPTS):
        prompts.append(rotate(EXPLAIN_CONCEPT_TEMPLATES, index).format(concept=concept))
    for index, (first, second) in enumerate(EXPLAIN_DIFFERENCE_PAIRS):
        prompts.append(rotate(EXPLAIN_DIFFERENCE_TEMPLATES, index).format(first=first, second=second))
    for index, thing in enumerate(EXPLAIN_HOW_THINGS_WORK):
        prompts.append(rotate(EXPLAIN_HOW_TEMPLATES, index).format(thing=thing))
    prompts.extend(EXPLAIN_OPEN_QUESTIONS)
    return unique_in_order(prompts)


# ---------------------------------------------------------------------------
# Chat prompts
# ---------------------------------------------------------------------------


def chat_prompts() -> list[str]:
    prompts: list[str] = []
    for index, scenario in enumerate(EMAIL_SCENARIOS):
        prompts.append(rotate(EMAIL_TEMPLATES, index).format(scenario=scenario))
    for index, scenario in enumerate(TEXT_MESSAGE_SCENARIOS):
        prompts.append(rotate(TEXT_MESSAGE_TEMPLATES, index).format(scenario=scenario))
    prompts.extend(ADVICE_QUESTIONS)
    for index, (count, thing) in enumerate(LIST_REQUESTS):
        prompts.append(rotate(LIST_TEMPLATES, index).format(count=count, thing=thing))
    # Each paragraph is used with both templates: summaries are a common
    # request and the paragraphs are the scarcest hand-written material.
    for paragraph in PARAGRAPHS_TO_SUMMARIZE:
        for template in SUMMARY_TEMPLATES:
            prompts.append(template.format(paragraph=paragraph))
    for index, question in enumerate(TRIVIA_QUESTIONS):
        prompts.append(rotate(TRIVIA_TEMPLATES, index).format(question=question))
    for index, sentence in enumerate(BLUNT_SENTENCES):
        prompts.append(rotate(POLITE_REWRITE_TEMPLATES, index).format(sentence=sentence))
    for index, sentence in enumerate(SENTENCES_WITH_ERRORS):
        prompts.append(rotate(GRAMMAR_FIX_TEMPLATES, index).format(sentence=sentence))
    for index, topic in enumerate(CREATIVE_TOPICS):
        prompts.append(rotate(CREATIVE_TEMPLATES, index).format(topic=topic))
        # A second, different form, so each topic appears as two genres.
        prompts.append(rotate(CREATIVE_TEMPLATES, index + 1).format(topic=topic))
    prompts.extend(PLANNING_REQUESTS)
    prompts.extend(NAMING_REQUESTS)
    prompts.extend(GENERAL_ASSISTANT_REQUESTS)
    return unique_in_order(prompts)


# ---------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------


def interleave_round_robin(columns: list[list[dict]]) -> list[dict]:
    """Take one row from each column in turn, skipping columns that ran out."""
    rows: list[dict] = []
    for position in range(max(len(column) for column in columns)):
        for column in columns:
            if position < len(column):
                rows.append(column[position])
    return rows


def build_rows() -> list[dict]:
    validation_rows = [
        {"prompt": prompt, "category": "coding", "split": "val"}
        for prompt in VALIDATION_CODING_PROMPTS
    ]
    training_prompts = {
        "coding": coding_training_prompts(),
        "math": math_prompts(),
        "explain": explain_prompts(),
        "chat": chat_prompts(),
    }
    columns = []
    for category in CATEGORIES:
        prompts = list(training_prompts[category])
        # Shuffle within a category so a prefix of the file is not all one
        # template family (e.g. all SQL, or all stdlib prompts).
        seeded_rng(f"order:{category}").shuffle(prompts)
        columns.append([{"prompt": prompt, "category": category} for prompt in prompts])
    rows = validation_rows + interleave_round_robin(columns)
    check_rows(rows)
    return rows


def check_rows(rows: list[dict]) -> None:
    """Fail loudly rather than write a file that breaks the pipeline's assumptions."""
    seen: dict[str, int] = {}
    for line_number, row in enumerate(rows, start=1):
        prompt = row["prompt"]
        if not prompt.strip():
            raise ValueError(f"row {line_number}: empty prompt")
        if row["category"] not in CATEGORIES:
            raise ValueError(f"row {line_number}: unknown category {row['category']!r}")
        word_count = len(prompt.split())
        if word_count > MAX_PROMPT_WORDS:
            raise ValueError(f"row {line_number}: prompt has {word_count} words: {prompt[:60]!r}")
        key = normalize_for_dedup(prompt)
        if key in seen:
            raise ValueError(f"row {line_number} repeats row {seen[key]}: {prompt[:60]!r}")
        seen[key] = line_number


def write_jsonl(rows: list[dict], out_path: Path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n" keeps the bytes identical on every platform.
    with out_path.open("w", encoding="utf-8", newline="\n") as out_file:
        for row in rows:
            out_file.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT_PATH,
        help=f"where to write the JSONL file (default: {DEFAULT_OUT_PATH.name} next to this script)",
    )
    args = parser.parse_args(argv)

    rows = build_rows()
    write_jsonl(rows, args.out)

    validation_count = sum(1 for row in rows if row.get("split") == "val")
    for category in CATEGORIES:
        count = sum(1 for row in rows if row["category"] == category)
        print(f"{category:8s} {count:5d}")
    print(f"{'val':8s} {validation_count:5d}  (coding, pinned first)")
    print(f"{'total':8s} {len(rows):5d}  -> {args.out}")


if __name__ == "__main__":
    main()
