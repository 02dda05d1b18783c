"""Real text for the demo, the examples, the tests and the benchmarks: a handbook used as a long system prompt.

Prefix caching pays off on long shared prompts with several questions about them, so the demo
and the real-model tests need a document a chat model can answer from, not random ids.

>>> len(HANDBOOK.split()) > 500
True
"""

from __future__ import annotations

HANDBOOK = """\
Northwind Cycles: staff handbook for the service desk

1. Who we are. Northwind Cycles is a bicycle shop founded in 1987 in Bergen, Norway. We sell city
bikes, touring bikes, cargo bikes and electric bikes, and we run a repair workshop behind the
shop. The shop opens at 9:00 and closes at 18:00 on weekdays, and opens from 10:00 to 16:00 on
Saturdays. We are closed on Sundays and on public holidays. The workshop takes its last repair
of the day at 16:30.

2. Prices and payment. Every price on the shelf includes value added tax at 25 percent. We accept
cards, mobile payments and cash. We do not accept cheques. Customers who buy a bike costing more
than 20,000 kroner may pay in twelve monthly instalments without interest; the first instalment
is paid on the day of purchase.

3. Returns. An unused item in its original packaging may be returned within 30 days with its
receipt, and the customer gets the full price back in the way they paid. Bikes that have been
ridden may be returned within 14 days if they have been ridden less than 50 kilometres; we then
keep a handling fee of 5 percent. Helmets, inner tubes and saddles that have been used cannot be
returned for reasons of hygiene and safety.

4. Warranty. Frames carry a ten year warranty against breakage. Forks, wheels and components
carry a two year warranty. Batteries of electric bikes carry a two year warranty or 500 charge
cycles, whichever comes first. The warranty does not cover wear parts such as chains, brake pads,
tyres and cables, nor damage from crashes, from racing or from using the bike for hire.

5. Repairs. A standard service costs 890 kroner and includes adjusting brakes and gears,
truing both wheels, checking bearings, cleaning and oiling the chain and a test ride. A full
service costs 1,690 kroner and also includes replacing cables and housing, bleeding hydraulic
brakes and servicing the hubs. Parts are charged separately. We give an estimate before any work
above 500 kroner, and we always call the customer before doing work that was not agreed. A bike
that has been ready for more than 30 days is charged a storage fee of 50 kroner per day.

6. Electric bikes. We service the motor systems of Bosch, Shimano and Brose. We do not open
motors or batteries ourselves: they go to the maker, which takes about three weeks. A battery
that is swollen, cracked or has been in water must not be charged; put it in the fire-safe box in
the workshop and tell the workshop manager at once.

7. Test rides. Customers may test ride any bike in the shop for up to 30 minutes. Ask for
photo identification and keep it at the desk until the bike comes back. Children under 16 may
test ride only with a parent present. Electric cargo bikes are test ridden on the course in the
back yard, not on the street.

8. Rentals. We rent city bikes for 250 kroner a day and electric bikes for 450 kroner a day, with
a helmet and a lock included. A deposit of 2,000 kroner is taken on the customer's card and
released when the bike is returned undamaged. A lost lock costs 400 kroner. A late return costs
one extra day for every started 24 hours.

9. Fitting. A bike fit takes one hour and costs 1,200 kroner. It is free for customers who buy
a bike costing more than 30,000 kroner, if it is booked within 60 days of the purchase. The
fitter adjusts saddle height and setback, handlebar reach and height, and cleat position.

10. Complaints. Listen to the customer, write down what happened, and give them the complaint
form. Every complaint is answered by the shop manager within five working days. If a customer
is unhappy with a repair, the workshop redoes the work for free within 14 days.

11. Safety in the workshop. Wear safety glasses when cutting cables, truing wheels under tension
or using compressed air. Gloves must be worn when handling brake fluid. The first aid kit is by
the back door, and the fire extinguisher is beside the fire-safe battery box.

12. Loyalty club. Members get 10 percent off parts and accessories, one free standard service
per year, and invitations to the spring and autumn group rides. Membership is free and needs
only a name, a phone number and an email address.
"""
"""A real document to build long shared prompts from: a bicycle shop's staff handbook, 12 numbered sections.

About 1,100 SmolLM2 tokens of plain English that a chat model can answer questions from (hours,
prices, returns, warranty, repairs, ...). The demo, the benchmarks and the examples in
`integrations/` put it in front of each question, so that every question after the first reuses it.
Public as `hf_prefix_cache.HANDBOOK`.
"""

QUESTIONS = (
    "How long is the warranty on a frame?",
    "What does a standard service cost, and what does it include?",
    "Can I return a helmet I have worn once?",
    "What should I do with a swollen battery?",
    "How much does it cost to rent an electric bike for two days?",
    "When does the workshop take its last repair on a weekday?",
)

FOLLOW_UPS = (
    "Does that also cover the fork?",
    "And what if I am a member of the loyalty club?",
    "Thank you. Is the shop open on Sunday?",
)
