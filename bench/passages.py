"""Passages for the repetitive workloads of bench/speculation.py: requests that repeat or correct them.

PASSAGES are three sentences (about 60 tokens), PARAGRAPHS eight (about 160): the answer to a
rewriting request is as long as its passage, so the paragraphs weigh decoding against prefill as
rewriting a document does, and the passages as a short reply does.
"""

PASSAGES = [
    "The city council met on Tuesday evening to discuss the proposed budget for the coming year. Members "
    "debated funding for road repairs, public libraries and a new community swimming pool. After three "
    "hours of discussion, the council voted to approve the budget with minor changes.",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a pan over medium heat. Add one "
    "chopped onion and cook until soft, then stir in two cloves of garlic. Pour in a can of crushed "
    "tomatoes, season with salt and pepper, and let it simmer for twenty minutes.",
    "The library will be closed on Monday for maintenance. During this time, the heating system will be "
    "replaced and the reading room will be repainted. Books can still be returned through the drop box "
    "at the main entrance, and online services will remain available as usual.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide "
    "and water. It takes place mainly in the leaves, inside small structures called chloroplasts. The "
    "process releases oxygen into the air, which most living things need to breathe.",
    "Our team finished the first version of the mobile app last week. Users can now create an account, "
    "browse the catalogue and save items to a wish list. In the next release we plan to add payments, "
    "push notifications and a dark mode for the interface.",
    "The museum's new exhibition brings together more than two hundred paintings from private "
    "collections around the world. Visitors can follow the development of landscape painting over four "
    "centuries. Tickets are available online and at the museum's front desk.",
    "Regular exercise improves both physical and mental health. Walking for thirty minutes a day can "
    "lower blood pressure, strengthen the heart and improve sleep. Experts also recommend stretching and "
    "simple strength exercises at least twice a week.",
    "The train to the coast leaves every hour from platform four. The journey takes about ninety "
    "minutes and passes through several small villages and along a wide river valley. Bicycles are "
    "allowed on board, but passengers should book a space in advance.",
]

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the proposed budget for the coming year. The "
    "meeting began with a short presentation from the finance director, who explained that tax revenue "
    "had grown by four percent while the cost of energy and insurance had risen faster. Members then "
    "debated funding for road repairs, public libraries and a new community swimming pool. Several "
    "residents spoke during the public comment period, most of them in favour of the pool and against "
    "any cuts to library opening hours. One councillor proposed delaying the pool by a year to pay for "
    "more road repairs, but the motion failed by two votes. After three hours of discussion, the council "
    "voted to approve the budget with minor changes, and the mayor thanked the staff for their work.",
    "To make a simple tomato sauce, warm two tablespoons of olive oil in a large pan over medium heat. "
    "Add one chopped onion and a pinch of salt, and cook for about eight minutes, stirring now and then, "
    "until the onion is soft and golden. Stir in two cloves of crushed garlic and cook for one more "
    "minute, taking care that the garlic does not burn. Pour in a can of crushed tomatoes and half a cup "
    "of water, then add a teaspoon of sugar to balance the acidity. Season with salt and black pepper, "
    "bring the sauce to a gentle boil and let it simmer for twenty minutes, until it has thickened. "
    "Finish with a handful of fresh basil leaves and serve it over pasta or keep it in the fridge.",
    "The library will be closed on Monday and Tuesday next week for maintenance. During this time, the "
    "old heating system will be replaced, the reading room will be repainted and new lights will be "
    "installed in the children's section. Books can still be returned through the drop box at the main "
    "entrance, and no late fees will be charged for items due on those days. Online services, including "
    "the catalogue, electronic books and the homework help desk, will remain available as usual. The "
    "library will open again on Wednesday morning at nine o'clock, with a small celebration in the "
    "reading room at eleven. We apologise for any inconvenience and thank our visitors for their patience.",
    "Photosynthesis is the process by which green plants, algae and some bacteria use the energy of "
    "sunlight to make food from carbon dioxide and water. It takes place mainly in the leaves, inside "
    "small structures called chloroplasts, which contain a green pigment called chlorophyll. The "
    "chlorophyll absorbs light, mostly in the blue and red parts of the spectrum, and uses its energy to "
    "split water molecules. The hydrogen from the water is combined with carbon dioxide to build sugars, "
    "which the plant uses for energy and growth. The process releases oxygen into the air as a by-product, "
    "and most living things on Earth need this oxygen to breathe. Without photosynthesis, there would be "
    "almost no food and very little oxygen on our planet.",
    "Our team finished the first version of the mobile app last week, two days ahead of schedule. Users "
    "can now create an account, browse the catalogue, search for products by name or category and save "
    "items to a wish list. The app works on both phones and tablets, and early testers said that it was "
    "fast and easy to use. We fixed more than forty bugs during the final week, most of them small "
    "problems with the layout on older devices. In the next release we plan to add payments, push "
    "notifications and a dark mode for the interface. We will also improve the search results and add "
    "support for two more languages. Thank you all for your hard work and for the many good ideas you "
    "shared during the project.",
    "The museum's new exhibition brings together more than two hundred paintings from private "
    "collections around the world, many of which have never been shown in public before. Visitors can "
    "follow the development of landscape painting over four centuries, from small religious scenes with "
    "distant hills to large views of mountains, rivers and cities. The exhibition is divided into six "
    "rooms, each devoted to one period, and a short film at the entrance explains how the paintings were "
    "found and restored. Guided tours take place every afternoon at two and four o'clock, and there is a "
    "special programme for schools on weekday mornings. Tickets are available online and at the museum's "
    "front desk, and entry is free for children under twelve.",
    "Regular exercise improves both physical and mental health at every age. Walking for thirty minutes a "
    "day can lower blood pressure, strengthen the heart and improve sleep, and it needs no special "
    "equipment. Exercise also reduces stress and helps many people feel calmer and more focused at work. "
    "Experts recommend at least one hundred and fifty minutes of moderate activity each week, such as fast "
    "walking, cycling or swimming. They also recommend stretching and simple strength exercises at least "
    "twice a week, because strong muscles protect the joints and help prevent falls. People who have not "
    "exercised for a long time should start slowly and increase the effort step by step. It is never too "
    "late to begin, and even small changes make a real difference.",
    "The train to the coast leaves every hour from platform four, starting at six in the morning. The "
    "journey takes about ninety minutes and passes through several small villages and along a wide river "
    "valley with fine views of the hills. There is a café car at the front of the train that serves hot "
    "drinks, sandwiches and cakes until early evening. Bicycles are allowed on board, but passengers "
    "should book a space in advance, because there are only six places on each train. Tickets can be "
    "bought at the station, on the railway's website or with the mobile app, and children under five "
    "travel free. On summer weekends the trains are often full, so it is a good idea to arrive early. The "
    "last train back from the coast leaves at ten past nine in the evening.",
]
