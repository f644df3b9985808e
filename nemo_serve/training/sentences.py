"""The demo corpus's sentences: templates over a fixed vocabulary (digits, numbers up to a thousand,
ordinals, days, months, a few hundred common English words and voice-assistant commands)."""

from __future__ import annotations

import random


ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEENS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
            "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth",
            "seventeenth", "eighteenth", "nineteenth", "twentieth", "twenty first", "twenty second",
            "twenty third", "twenty fourth", "twenty fifth", "twenty sixth", "twenty seventh",
            "twenty eighth", "twenty ninth", "thirtieth", "thirty first"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december"]

COMMON = """the of and to a in is it you that he was for on are with as i his they be at one have
this from or had by word but what some we can out other were all there when up use your how said
an each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get place
made live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick
develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot
system busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran
check game shape equate hot miss brought heat snow tire bring yes distant fill east paint language
among""".split()

COMMAND_WORDS = """please turn on off set timer alarm remind me what is weather today tomorrow tonight
play pause stop resume next previous song music volume up down louder quieter lights kitchen
bedroom living room bathroom garage temperature degrees call send message text open close lock
unlock door window thermostat heat cool fan minutes seconds hours wake at am pm noon midnight
morning evening afternoon add shopping list calendar meeting schedule cancel show news read
navigate home work directions traffic how long will it take hey assistant thanks thank you yes
no okay cancel repeat skip shuffle radio station podcast battery brightness screen camera photo
start stop timer weekend week month year percent half quarter past to""".split()

ROOMS = ["kitchen", "bedroom", "living room", "bathroom", "garage", "office", "hallway", "garden"]
DEVICES = ["lights", "fan", "heater", "radio", "television", "music", "camera", "alarm", "lamp"]
TASKS = ["call mother", "buy milk", "water the plants", "check the mail", "feed the dog",
         "read the news", "pay the bill", "clean the house", "walk the dog", "go to school",
         "take the medicine", "send the letter", "start the car", "close the window", "open the door",
         "write the story", "study for the test", "call my friend", "book a table", "plan the trip"]
UNITS = ["minutes", "seconds", "hours", "days", "weeks", "degrees", "percent", "miles", "pounds",
         "dollars", "people", "books", "songs", "steps"]


def number_words(n: int) -> str:
    """0..1000 in words, American style without 'and' (e.g. 'three hundred twenty one')."""
    if n < 10:
        return ONES[n]
    if n < 20:
        return TEENS[n - 10]
    if n < 100:
        t, o = divmod(n, 10)
        return TENS[t] + ("" if o == 0 else " " + ONES[o])
    if n < 1000:
        h, r = divmod(n, 100)
        return ONES[h] + " hundred" + ("" if r == 0 else " " + number_words(r))
    if n == 1000:
        return "one thousand"
    raise ValueError(n)


def rand_number(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        return number_words(rng.randint(0, 20))
    if r < 0.7:
        return number_words(rng.randint(21, 99))
    return number_words(rng.randint(100, 1000))


def rand_time(rng: random.Random) -> str:
    h = number_words(rng.randint(1, 12))
    m = rng.choice(["", " fifteen", " thirty", " forty five", " " + number_words(rng.randint(10, 59))])
    ap = rng.choice(["", " am", " pm", " in the morning", " in the evening"])
    return h + m + ap


def rand_date(rng: random.Random) -> str:
    d, m = rng.choice(ORDINALS), rng.choice(MONTHS)
    return rng.choice([f"{m} {d}", f"the {d} of {m}", f"{rng.choice(DAYS)} {m} {d}"])


def rand_words(rng: random.Random, pool: list[str], lo: int, hi: int) -> str:
    return " ".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))


TEMPLATES = [
    lambda r: f"set a timer for {rand_number(r)} {r.choice(['minutes', 'seconds', 'hours'])}",
    lambda r: f"set an alarm for {rand_time(r)}",
    lambda r: f"wake me up at {rand_time(r)} on {r.choice(DAYS)}",
    lambda r: f"turn {r.choice(['on', 'off'])} the {r.choice(ROOMS)} {r.choice(DEVICES)}",
    lambda r: f"please turn {r.choice(['up', 'down'])} the volume",
    lambda r: f"set the volume to {rand_number(r)} percent",
    lambda r: f"set the temperature to {rand_number(r)} degrees",
    lambda r: f"what is the weather {r.choice(['today', 'tomorrow', 'tonight', 'on ' + r.choice(DAYS)])}",
    lambda r: f"remind me to {r.choice(TASKS)} on {r.choice(DAYS)}",
    lambda r: f"remind me to {r.choice(TASKS)} at {rand_time(r)}",
    lambda r: f"add {rand_number(r)} {r.choice(['apples', 'eggs', 'books', 'boxes'])} to the shopping list",
    lambda r: f"schedule a meeting on {rand_date(r)}",
    lambda r: f"my birthday is on {rand_date(r)}",
    lambda r: f"today is {r.choice(DAYS)} {rand_date(r)}",
    lambda r: f"the next meeting is on {r.choice(DAYS)} at {rand_time(r)}",
    lambda r: f"{r.choice(['play', 'pause', 'stop', 'skip', 'shuffle', 'repeat'])} the {r.choice(['music', 'song', 'radio', 'podcast'])}",
    lambda r: f"{r.choice(['open', 'close', 'lock', 'unlock'])} the {r.choice(['door', 'window', 'garage', 'front door'])}",
    lambda r: f"call {r.choice(['mother', 'father', 'my friend', 'the school', 'home', 'work'])}",
    lambda r: f"how long will it take to drive {r.choice(['home', 'to work', 'to school', 'to the city'])}",
    lambda r: f"the number is {' '.join(r.choice(ONES) for _ in range(r.randint(3, 8)))}",
    lambda r: " ".join(r.choice(ONES) for _ in range(r.randint(2, 9))),
    lambda r: f"{rand_number(r)} {r.choice(UNITS)}",
    lambda r: f"{rand_number(r)} {r.choice(['plus', 'minus', 'times'])} {rand_number(r)}",
    lambda r: f"in {r.choice(MONTHS)} there are {rand_number(r)} {r.choice(UNITS)}",
    lambda r: f"{r.choice(DAYS)} {r.choice(['morning', 'afternoon', 'evening', 'night'])}",
    lambda r: f"{r.choice(MONTHS)} {r.choice(ORDINALS)}",
    lambda r: rand_words(r, COMMON, 3, 9),
    lambda r: rand_words(r, COMMON, 3, 9),
    lambda r: rand_words(r, COMMON, 3, 9),
    lambda r: rand_words(r, COMMON + COMMAND_WORDS, 3, 8),
    lambda r: f"{rand_words(r, COMMAND_WORDS, 1, 3)} {rand_words(r, COMMON, 2, 5)}",
    lambda r: f"hey assistant {rand_words(r, COMMAND_WORDS, 2, 5)}",
]


def make_sentence(rng: random.Random) -> str:
    s = rng.choice(TEMPLATES)(rng)
    return " ".join(s.lower().split())


def vocabulary() -> set[str]:
    words = set(ONES + TEENS + TENS[2:] + DAYS + MONTHS + COMMON + COMMAND_WORDS + ROOMS + DEVICES + UNITS)
    for o in ORDINALS:
        words.update(o.split())
    for t in TASKS:
        words.update(t.split())
    words.update("hundred thousand plus minus times apples eggs books boxes front".split())
    return {w for w in words if w}


def unique_sentences(rng: random.Random, n: int, exclude: set[str], max_words: int = 14) -> list[str]:
    out, seen = [], set(exclude)
    while len(out) < n:
        s = make_sentence(rng)
        if s in seen or len(s.split()) > max_words:
            continue
        seen.add(s)
        out.append(s)
    return out


def held_out_sets(rng: random.Random, n: int, count: int = 4) -> list[list[str]]:
    """The corpus's first draws: `count` sets of n sentences (dev, heldout_sentences, heldout_voices,
    flite), each unseen by the ones before. Drawn first, so every later split can exclude them all."""
    sets, seen = [], set()
    for _ in range(count):
        sets.append(unique_sentences(rng, n, seen))
        seen |= set(sets[-1])
    return sets


def training_sentences(rng: random.Random, n: int, exclude: set[str], max_words: int = 14) -> list[str]:
    """Up to n training sentences, none in `exclude` nor longer than `max_words`. Always 2n draws
    (repeats kept), so the splits drawn after it do not depend on what this one rejected."""
    drawn = [make_sentence(rng) for _ in range(n * 2)]
    return [s for s in drawn if s not in exclude and len(s.split()) <= max_words][:n]
