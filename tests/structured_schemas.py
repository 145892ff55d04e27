"""Twenty response schemas (pydantic models, as clients write them for
`client.chat.completions.parse`) and twenty prompts, for the structured-output
tests and benchmark: nested objects, arrays, enums, numbers with ranges,
optional fields, strings with patterns. Strings and arrays are bounded, as a
production schema for a small model should be, so that every answer ends
(numbers are integers: nothing bounds the digits of a float, and a 135M
model can write them until max_tokens)."""
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Short = Annotated[str, Field(max_length=24)]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: Short
    country: Short
    population: int = Field(ge=0, le=40_000_000)
    capital: bool


class Address(BaseModel):
    street: Short
    city: Short
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Employee(BaseModel):
    person: Person
    address: Address
    title: Short


class Weather(BaseModel):
    city: Short
    celsius: int = Field(ge=-60, le=60)
    sky: Literal["sunny", "cloudy", "rain", "snow"]


class Tags(BaseModel):
    tags: list[Short] = Field(min_length=1, max_length=3)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Polygon(BaseModel):
    name: Short
    points: list[Point] = Field(min_length=3, max_length=4)


class Book(BaseModel):
    title: Short
    author: Short
    year: int = Field(ge=1400, le=2030)
    isbn: Annotated[str, Field(pattern=r"^[0-9]{3}-[0-9]{10}$")]


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    summary: Short
    recommend: bool


class Product(BaseModel):
    name: Short
    price: int = Field(ge=0, le=10_000)
    currency: Literal["USD", "EUR", "GBP"]
    color: Color | None = None


class Event(BaseModel):
    title: Short
    date: Annotated[str, Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")]
    attendees: int = Field(ge=0, le=1000)


class Recipe(BaseModel):
    dish: Short
    ingredients: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1, max_length=2)
    minutes: int = Field(ge=1, le=600)


class Team(BaseModel):
    name: Short
    members: list[Person] = Field(min_length=1, max_length=2)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    score: int = Field(ge=0, le=100)


class Contact(BaseModel):
    name: Short
    email: Annotated[str, Field(pattern=r"^[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)$")]
    phone: Annotated[str, Field(pattern=r"^\+[0-9]{2} [0-9]{3} [0-9]{4}$")] | None = None


class Flight(BaseModel):
    code: Annotated[str, Field(pattern=r"^[A-Z]{2}[0-9]{3,4}$")]
    origin: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]
    destination: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]
    seats: int = Field(ge=0, le=500)


class Inventory(BaseModel):
    warehouse: Short
    items: list[Product] = Field(min_length=1, max_length=2)


class Answer(BaseModel):
    answer: Literal["yes", "no", "unsure"]
    confidence: int = Field(ge=0, le=100)
    reason: Short | None = None


class Matrix(BaseModel):
    rows: list[Annotated[list[Annotated[int, Field(ge=0, le=99)]], Field(min_length=2, max_length=2)]] = \
        Field(min_length=2, max_length=2)
    label: Color


SCHEMAS = [Person, City, Address, Employee, Weather, Tags, Polygon, Book, Review, Product,
           Event, Recipe, Team, Sentiment, Contact, Flight, Inventory, Answer, Matrix, Point]

PROMPTS = [
    "Tell me about a friend of yours.",
    "Describe Paris.",
    "Where do you live?",
    "Write a short record about a new employee.",
    "What is the weather like today?",
    "Give me some labels for a photo of a beach.",
    "Describe a shape.",
    "Recommend a book.",
    "Review the last film you saw.",
    "Describe something you would sell online.",
    "Plan a party.",
    "How do I cook pasta?",
    "Who is on your football team?",
    "How does this sentence feel: I love sunny days.",
    "Give me the contact details of a plumber.",
    "Book me a flight from Boston to Denver.",
    "What is in the store room?",
    "Is the Earth round?",
    "Make up some numbers.",
    "Output an example.",
]
