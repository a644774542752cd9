"""``webshop``: a small WebShop-like shopping environment over a generated product catalogue.

After WebShop (Yao et al., 2022), scaled down and generated: every ``reset`` seed gives a catalogue
of ``n_products`` products and a goal instruction built from one of them (:func:`build_world`, a
pure function of seed and size), with near misses of the goal in the catalogue.

Actions (WebShop's syntax; the first in the text counts, any case): ``search[<words>]``
(:func:`search`), ``click[<product id>]``, ``click[next page]`` / ``click[prev page]`` /
``click[back]`` / ``click[back to search]``, ``select[<option>]`` (a colour or size on a product
page) and ``buy``, which ends the episode with WebShop's reward (:func:`score`: the product type,
the goal's attributes and options matched, and the price against the budget); ``success`` iff
it is 1. Anything else, or an action that does not apply on the current page, is an invalid
action (reward 0). The episode truncates after ``max_turns`` turns without ``buy``. ``info``:
``state_hash``, ``success``, ``invalid_action``, ``turn``, ``page``; ``reset`` adds ``seed``,
``buy`` adds ``bought``, ``matched`` and ``total``.

Task source ``webshop`` (:class:`WebShopSource`, an :class:`envs.gym_text.EpisodeSource`): the
expert searches the goal's words, pages to the first listed product that satisfies the goal,
selects the goal's options and buys. Details: docs/agentic.md, "The environments".
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

from envs.base import StepResult, check_heldout_fraction, reject_unknown
from envs.gym_text import EpisodeSource, turns_left
from envs.registry import register_env, register_source

NAME = "webshop"
DEMO_SEP = "\n---\n"

DEPARTMENTS: dict[str, dict[str, Any]] = {
    "clothing": {
        "types": ["t-shirt", "hoodie", "jeans", "jacket", "dress", "sweater", "shorts"],
        "attrs": ["cotton", "wool", "linen", "organic", "slim-fit", "relaxed-fit", "waterproof", "breathable",
                  "stretch", "fleece", "quick-dry"],
        "sizes": ["XS", "S", "M", "L", "XL"],
        "price": (9, 90),
    },
    "shoes": {
        "types": ["sneakers", "boots", "sandals", "loafers", "slippers"],
        "attrs": ["leather", "waterproof", "lightweight", "non-slip", "breathable", "memory-foam", "vegan",
                  "suede", "cushioned"],
        "sizes": ["6", "7", "8", "9", "10", "11", "12"],
        "price": (19, 160),
    },
    "home": {
        "types": ["mug", "lamp", "pillow", "blanket", "towel", "vase", "candle"],
        "attrs": ["ceramic", "glass", "bamboo", "handmade", "dishwasher-safe", "washable", "soft", "minimalist",
                  "scented", "recycled"],
        "sizes": ["small", "medium", "large"],
        "price": (6, 80),
    },
    "electronics": {
        "types": ["headphones", "speaker", "charger", "keyboard", "mouse", "webcam"],
        "attrs": ["wireless", "bluetooth", "noise-cancelling", "rechargeable", "portable", "usb-c", "ergonomic",
                  "waterproof", "compact"],
        "sizes": [],
        "price": (10, 200),
    },
    "bags": {
        "types": ["backpack", "wallet", "duffel", "tote", "messenger"],
        "attrs": ["leather", "waterproof", "lightweight", "vegan", "rfid-blocking", "padded", "canvas", "foldable"],
        "sizes": [],
        "price": (12, 150),
    },
}
COLORS = ["red", "blue", "black", "white", "green", "gray", "navy", "pink", "beige", "brown", "yellow", "purple"]
BRANDS = ["Acme", "Northwind", "Zephyr", "Lumen", "Orchid", "Granite", "Kestrel", "Maple", "Solace", "Tundra",
          "Vireo", "Quill", "Harbor", "Ember", "Juniper", "Nimbus", "Pebble", "Sequoia", "Willow", "Atlas"]
_OPENERS = ["i need", "i am looking for", "find me", "i want to buy", "please find"]
_TOKEN_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_BRACKET_RE = re.compile(r"\b(search|click|select)\s*\[([^\]\n]*)\]", re.IGNORECASE)
_BUY_RE = re.compile(r"^[\s>*#-]*(?:action\s*:\s*)?buy(?:\s+now)?\s*[.!]?\s*$", re.IGNORECASE)


def tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(text.lower())


@dataclass(frozen=True)
class Product:
    pid: str
    name: str
    dept: str
    type: str
    attrs: tuple[str, ...]
    colors: tuple[str, ...]
    sizes: tuple[str, ...]
    price: float
    words: frozenset[str]


@dataclass(frozen=True)
class Goal:
    type: str
    dept: str
    attrs: tuple[str, ...]
    color: str
    size: str
    """"" when the type comes in one size."""
    budget: float
    text: str
    query: str
    """The expert's search words."""

    def satisfied_by(self, p: Product) -> bool:
        return (p.type == self.type and set(self.attrs) <= set(p.attrs) and self.color in p.colors
                and (not self.size or self.size in p.sizes) and p.price <= self.budget)


@dataclass(frozen=True)
class World:
    goal: Goal
    products: tuple[Product, ...]
    by_id: dict[str, Product]


def _product(rng: random.Random, dept: str, ptype: str, attrs: list[str] | None = None,
             colors: list[str] | None = None, sizes: list[str] | None = None, price: float | None = None) -> dict:
    d = DEPARTMENTS[dept]
    if attrs is None:
        attrs = rng.sample(d["attrs"], 3)
    if colors is None:
        colors = rng.sample(COLORS, rng.randint(2, 5))
    if sizes is None:
        sizes = d["sizes"][:] if not d["sizes"] or rng.random() < 0.5 else \
            sorted(rng.sample(d["sizes"], rng.randint(2, len(d["sizes"]))), key=d["sizes"].index)
    if price is None:
        lo, hi = d["price"]
        price = rng.randint(lo, hi) - 0.01
    return {"dept": dept, "type": ptype, "attrs": tuple(attrs), "colors": tuple(colors), "sizes": tuple(sizes),
            "price": round(price, 2), "brand": rng.choice(BRANDS)}


def build_world(seed: int, n_products: int) -> World:
    """The catalogue and goal of episode ``seed`` (a pure function of its arguments)."""
    rng = random.Random(f"{NAME}|{seed}|{n_products}")
    dept = rng.choice(sorted(DEPARTMENTS))
    d = DEPARTMENTS[dept]
    ptype = rng.choice(d["types"])
    target = _product(rng, dept, ptype)
    goal_attrs = tuple(rng.sample(target["attrs"], rng.randint(1, 2)))
    color = rng.choice(target["colors"])
    size = rng.choice(target["sizes"]) if target["sizes"] else ""
    budget = float(math.ceil(target["price"] * rng.uniform(1.1, 1.6) / 5) * 5)
    items = [target]
    kinds = ["attr", "color", "size", "price", "type"]
    for i in range(min(n_products - 1, rng.randint(6, 10))):
        kind = kinds[i % len(kinds)]
        others = [a for a in d["attrs"] if a not in goal_attrs]
        attrs = [*goal_attrs, *rng.sample(others, 3 - len(goal_attrs))]
        colors = [color, *rng.sample([c for c in COLORS if c != color], rng.randint(1, 3))]
        sizes = list(d["sizes"])
        price = rng.randint(int(budget * 0.4), int(budget)) - 0.01
        t = ptype
        if kind == "attr":
            drop = rng.choice(goal_attrs)
            attrs = [a for a in attrs if a != drop]
            attrs.append(rng.choice([a for a in others if a not in attrs]))
        elif kind == "color":
            colors = [c for c in colors if c != color] or [rng.choice([c for c in COLORS if c != color])]
        elif kind == "size" and size:
            sizes = [s for s in sizes if s != size]
        elif kind in ("price", "size"):
            price = rng.randint(int(budget) + 1, int(budget * 1.6) + 2) - 0.01
        else:
            t = rng.choice([x for x in d["types"] if x != ptype])
        rng.shuffle(attrs)
        items.append(_product(rng, dept, t, attrs, colors, sizes, price))
    while len(items) < n_products:
        dd = rng.choice(sorted(DEPARTMENTS))
        items.append(_product(rng, dd, rng.choice(DEPARTMENTS[dd]["types"])))
    rng.shuffle(items)
    ids = rng.sample(range(1000, 10000), len(items))
    products = []
    for pid_n, it in zip(ids, items, strict=True):
        name = f"{it['brand']} {' '.join(it['attrs'])} {it['type']}"
        words = frozenset(tokens(" ".join([name, it["dept"], *it["colors"], *it["sizes"]])))
        products.append(Product(f"P{pid_n}", name, it["dept"], it["type"], it["attrs"], it["colors"], it["sizes"],
                                it["price"], words))
    phrase = " ".join([color, *goal_attrs, ptype])
    text = f"{rng.choice(_OPENERS)} a {phrase}" + (f" in size {size.lower()}" if size else "") + \
        f", and price lower than {budget:.2f} dollars"
    query = phrase + (f" {size.lower()}" if size else "")
    goal = Goal(ptype, dept, goal_attrs, color, size, budget, text, query)
    return World(goal, tuple(products), {p.pid.lower(): p for p in products})


def search(world: World, query: str) -> list[Product]:
    """Products with at least one query word, best first (score, then catalogue order)."""
    q = set(tokens(query))
    scored = [(-len(q & p.words), i, p) for i, p in enumerate(world.products)]
    return [p for s, _, p in sorted(scored, key=lambda t: (t[0], t[1])) if s < 0]


def score(goal: Goal, product: Product, selected: dict[str, str]) -> tuple[float, int, int]:
    """WebShop's reward for buying ``product`` with ``selected`` options: ``(reward, matched, total)``."""
    r_type = 1.0 if product.type == goal.type else 0.5 if product.dept == goal.dept else 0.1
    want = {"color": goal.color, **({"size": goal.size} if goal.size else {})}
    matched = (sum(a in product.attrs for a in goal.attrs)
               + sum(selected.get(k, "").lower() == v.lower() for k, v in want.items())
               + int(product.price <= goal.budget))
    total = len(goal.attrs) + len(want) + 1
    return r_type * matched / total, matched, total


def parse_action(text: str) -> tuple[str, str]:
    """``(verb, argument)`` of the first action in ``text``: ``search``, ``click``, ``select``,
    ``buy`` or ``""`` (none found)."""
    for line in text.splitlines():
        m = _BRACKET_RE.search(line)
        if m is not None:
            verb, arg = m.group(1).lower(), " ".join(m.group(2).split())
            if verb == "click" and arg.lower() in ("buy", "buy now"):
                return "buy", ""
            return verb, arg
        if _BUY_RE.match(line):
            return "buy", ""
    return "", ""


# =========================================================================== kwargs


_KWARGS: dict[str, tuple[type, int, int]] = {
    "n_products": (int, 10, 2000),
    "max_turns": (int, 1, 100),
    "results_per_page": (int, 1, 50),
}
_DEFAULTS = {"n_products": 100, "max_turns": 10, "results_per_page": 5}


def _config(kwargs: dict[str, Any]) -> dict[str, int]:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("prompt", "reference")}
    reject_unknown(NAME, kwargs, _KWARGS)
    cfg = {**_DEFAULTS, **kwargs}
    for k, (_, lo, hi) in _KWARGS.items():
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{NAME}: {k}={v!r} must be an integer in [{lo}, {hi}]")
    return cfg


# =========================================================================== the environment

_BACK = frozenset({"back", "< back", "back to results"})
_BACK_TO_SEARCH = frozenset({"back to search", "search page", "home"})
_NEXT = frozenset({"next page", "next", "next >", "next page >"})
_PREV = frozenset({"prev page", "prev", "< prev", "previous page", "previous", "< prev page"})
_NAV = _BACK | _BACK_TO_SEARCH | _NEXT | _PREV
_HELP = ("Actions: search[words], click[product id], click[next page], click[prev page], click[back], "
         "select[option], buy.")


class WebShopEnv:
    """The ``webshop`` environment (see the module doc)."""

    def __init__(self, n_products: int = 100, max_turns: int = 10, results_per_page: int = 5) -> None:
        self.n_products, self.max_turns, self.per_page = n_products, max_turns, results_per_page
        self.world: World | None = None
        self.seed = 0
        self.done = True
        self._start()

    def _start(self) -> None:
        self.turn = 0
        self.page = "search"
        self.query = ""
        self.results: list[Product] = []
        self.page_idx = 0
        self.item: Product | None = None
        self.selected: dict[str, str] = {}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = random.SystemRandom().randrange(2**31) if seed is None else int(seed)
        self.world = build_world(self.seed, self.n_products)
        self._start()
        self.done = False
        obs = (f"WebShop. Instruction: {self.world.goal.text}.\n{_HELP}\n"
               f"Find the product, select its options, then buy. You have {self.max_turns} turns.\n[search page]")
        return obs, {**self._info(False, False), "seed": self.seed}

    # ------------------------------------------------------------------ state

    def state_hash(self) -> str:
        state = [self.seed, self.n_products, self.page, self.query, self.page_idx,
                 self.item.pid if self.item else "", sorted(self.selected.items())]
        return hashlib.sha1(json.dumps(state).encode()).hexdigest()[:12]

    def _info(self, success: bool, invalid: bool) -> dict[str, Any]:
        return {"state_hash": self.state_hash(), "success": success, "invalid_action": invalid,
                "turn": self.turn, "page": self.page}

    def _n_pages(self) -> int:
        return max(1, math.ceil(len(self.results) / self.per_page))

    def _visible(self) -> list[Product]:
        return self.results[self.page_idx * self.per_page:(self.page_idx + 1) * self.per_page]

    def _view(self) -> str:
        if self.page == "search":
            return "[search page]"
        if self.page == "results":
            if not self.results:
                return f'[no results for "{self.query}"]'
            head = (f'[results for "{self.query}", page {self.page_idx + 1}/{self._n_pages()}, '
                    f"{len(self.results)} items]")
            return "\n".join([head, *(f"[{p.pid}] {p.name} | ${p.price:.2f}" for p in self._visible())])
        p = self.item
        assert p is not None
        lines = [f"[product {p.pid}] {p.name}", f"price: ${p.price:.2f}", f"color: {', '.join(p.colors)}"]
        if p.sizes:
            lines.append(f"size: {', '.join(p.sizes)}")
        sel = ", ".join(f"{k}={v}" for k, v in sorted(self.selected.items()))
        lines.append(f"selected: {sel or 'nothing'}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ actions

    def _option(self, arg: str) -> tuple[str, str] | None:
        assert self.item is not None
        a = re.sub(r"^(colou?r|size)\s*[:=]?\s*", "", arg.strip().lower()).strip()
        for dim, values in (("color", self.item.colors), ("size", self.item.sizes)):
            for v in values:
                if v.lower() == a:
                    return dim, v
        return None

    def _apply(self, verb: str, arg: str) -> str:
        """Apply a parsed action; returns an error message ("" when it applied)."""
        assert self.world is not None
        low = arg.lower()
        if verb == "search":
            if not tokens(arg):
                return "empty search"
            self.query, self.results = arg, search(self.world, arg)
            self.page, self.page_idx, self.item, self.selected = "results", 0, None, {}
            return ""
        if verb == "select" or (verb == "click" and self.page == "item" and low not in _NAV):
            if self.page != "item":
                return "select[...] works on a product page"
            opt = self._option(arg)
            if opt is None:
                return f"{arg!r} is not an option of this product"
            self.selected[opt[0]] = opt[1]
            return ""
        if low in _BACK_TO_SEARCH or (low in _BACK and self.page == "results"):
            if self.page == "search":
                return "already on the search page"
            self.page, self.item, self.selected = "search", None, {}
            return ""
        if low in _BACK:
            if self.page == "search":
                return "already on the search page"
            self.page, self.item, self.selected = "results", None, {}
            return ""
        if low in _NEXT or low in _PREV:
            if self.page != "results":
                return "there are no result pages here; use click[back]" if self.page == "item" else \
                    "there are no result pages here; search first"
            step = 1 if low in _NEXT else -1
            if not 0 <= self.page_idx + step < self._n_pages():
                return f"there is no {'next' if step > 0 else 'previous'} page"
            self.page_idx += step
            return ""
        if self.page != "results":
            return "search first, then click a listed product"
        for p in self._visible():
            if p.pid.lower() == low:
                self.page, self.item, self.selected = "item", p, {}
                return ""
        return f"{arg!r} is not listed on this page"

    def step(self, action: str) -> StepResult:
        if self.done or self.world is None:
            raise RuntimeError("webshop: step() on a finished episode; call reset() first")
        self.turn += 1
        verb, arg = parse_action(action if isinstance(action, str) else str(action))
        if verb == "buy" and self.page == "item" and self.item is not None:
            reward, matched, total = score(self.world.goal, self.item, self.selected)
            success = reward >= 1.0 - 1e-9
            sel = ", ".join(f"{k}={v}" for k, v in sorted(self.selected.items())) or "no options"
            obs = f"You bought {self.item.pid} ({sel}). Score: {reward:.2f}."
            info = {**self._info(success, False), "bought": self.item.pid, "matched": matched, "total": total}
            self.page, self.done = "done", True
            info["page"] = "done"
            return StepResult(obs, reward, True, False, info)
        if verb == "buy":
            error = "buy works on a product page; click a product first"
        elif verb:
            error = self._apply(verb, arg)
        else:
            error = "no action found. " + _HELP
        body = f"Invalid action: {error}.\n{self._view()}" if error else self._view()
        footer, self.done = turns_left(self.turn, self.max_turns)
        return StepResult(body + footer, 0.0, False, self.done, self._info(False, bool(error)))


@register_env(NAME)
def make_webshop_env(**kwargs: Any) -> WebShopEnv:
    """Build a :class:`WebShopEnv` from JSON-scalar kwargs (``prompt``/``reference`` are ignored)."""
    return WebShopEnv(**_config(kwargs))


# =========================================================================== the task source


class WebShopSource(EpisodeSource):
    """Episodes of ``webshop`` as problems (:class:`envs.gym_text.EpisodeSource`: every seed its
    own catalogue). Registered as ``webshop``."""

    name = NAME
    salt = NAME
    demo_sep = DEMO_SEP

    def __init__(self, heldout_fraction: float = 0.05, **env_kwargs: Any) -> None:
        self.heldout_fraction = check_heldout_fraction(NAME, heldout_fraction)
        self.kwargs = _config(env_kwargs)

    def env_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def env(self) -> WebShopEnv:
        return WebShopEnv(**self.kwargs)

    def expert_actions(self, seed: int) -> list[str]:
        """Search the goal words, page to the first listed product that satisfies the goal, click
        it, select the goal's options, buy (falls back to the first result if none is listed)."""
        world = build_world(seed, self.kwargs["n_products"])
        goal = world.goal
        results = search(world, goal.query)
        idx = next((i for i, p in enumerate(results) if goal.satisfied_by(p)), 0)
        per_page = self.kwargs["results_per_page"]
        actions = [f"search[{goal.query}]", *["click[next page]"] * (idx // per_page),
                   f"click[{results[idx].pid}]", f"select[{goal.color}]"]
        if goal.size:
            actions.append(f"select[{goal.size}]")
        return [*actions, "buy"]


@register_source(NAME)
def make_webshop_source(**kwargs: Any) -> WebShopSource:
    """Build a :class:`WebShopSource`: the env kwargs plus ``heldout_fraction`` (default 0.05)."""
    return WebShopSource(**kwargs)
