"""Writes demo.jsonl, the project's own QA demo set, from the articles below.

    .venv/bin/python experiments/data/make_demo.py

Every article is original text about fictional places, people, inventions and companies,
written for kvstore. Each question is a direct lookup whose accepted answers appear verbatim in
its article. Edit the articles here, not the .jsonl (which repeats the context on every row),
then rerun this script and ``pytest tests/test_datasets.py`` (it checks the invariants: at
least 20 contexts of 300-2000 SmolLM2 tokens, at least 3 questions each).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "demo.jsonl"

# (id prefix, paragraphs, [(question, [accepted answers, first the preferred one])])
ARTICLES: list[tuple[str, list[str], list[tuple[str, list[str]]]]] = [
    (
        "harrow-bridge",
        [
            "The Harrow Bridge is a stone arch bridge that carries the old coach road over the River Leddon "
            "at the market town of Harrow Cross. Before it was built, travellers crossed by a ferry that "
            "could take only two carts at a time and stopped running whenever the river flooded, which "
            "happened in most winters.",
            "In 1868 the town council held a public competition for a permanent crossing. It was won by the "
            "engineer Matilda Crane, then twenty-nine years old, whose plan used five elliptical arches of "
            "local grey sandstone. Construction began in 1870, and the Harrow Bridge was completed in 1874 "
            "at a cost of 41,000 pounds, most of it raised through a toll that was collected until 1902.",
            "The bridge is 212 metres long and 9 metres wide. Its central arch, the largest of the five, "
            "spans 38 metres and was for a time the widest masonry arch in the county. Crane placed rounded "
            "cutwaters on the upstream side of each pier to break up floating ice, a detail that engineers "
            "later copied on several other bridges in the region.",
            "During the great flood of 1911 the water rose to within a metre of the parapet, but the bridge "
            "suffered no damage. It was closed to heavy lorries in 1968, when a concrete road bridge opened "
            "two kilometres downstream. Today the Harrow Bridge is used by walkers, cyclists and local "
            "traffic, and a bronze plaque at its eastern end records the name of its designer.",
        ],
        [
            ("In what year was the Harrow Bridge completed?", ["1874"]),
            ("Who designed the Harrow Bridge?", ["Matilda Crane", "Crane"]),
            ("Which river does the Harrow Bridge cross?", ["River Leddon", "the River Leddon", "Leddon"]),
            ("How long is the Harrow Bridge?", ["212 metres", "212"]),
        ],
    ),
    (
        "vessary",
        [
            "Vessary is a small island in the Colder Sea, about 60 kilometres off the northern coast of the "
            "mainland province of Ardhel. The island covers 148 square kilometres and is mostly low "
            "moorland, rising in the west to Mount Tarrow, a rounded hill of 403 metres from which the "
            "mainland cliffs can be seen on clear days.",
            "About 6,200 people live on Vessary. Almost half of them live in the capital, Port Anselm, a "
            "harbour town on the sheltered eastern shore. The rest are spread among farming villages and a "
            "handful of fishing settlements on the south coast. The islanders speak a dialect with many "
            "words borrowed from sailors, and the island newspaper, the Vessary Lantern, has appeared every "
            "week since 1887.",
            "Fishing was the main livelihood until the middle of the twentieth century. Today the main "
            "export of Vessary is seaweed, which is gathered at low tide, dried in long sheds near Port "
            "Anselm and sold to makers of fertiliser and food thickeners. Sheep farming and summer tourism "
            "provide most of the remaining income.",
            "Vessary is reached by a ferry from the mainland town of Kell, a crossing that takes about three "
            "hours. A small airstrip near the village of Drennick has flights twice a week, weather "
            "permitting. The island has one secondary school, one doctor's surgery and a lifeboat station, "
            "which was founded in 1923 after a cargo ship ran aground on the western reefs.",
        ],
        [
            ("What is the capital of Vessary?", ["Port Anselm"]),
            ("What is the main export of Vessary?", ["seaweed"]),
            ("About how many people live on Vessary?", ["6,200"]),
            ("From which mainland town does the ferry to Vessary leave?", ["Kell"]),
        ],
    ),
    (
        "calloway-lamp",
        [
            "The Calloway lamp is a safety lamp for coal miners. It was invented by Edwin Calloway, a mine "
            "surveyor from the valley town of Brackenmoor, who had lost two cousins in an underground "
            "explosion. Calloway spent four years testing designs in a sealed brick chamber filled with "
            "marsh gas, and the Calloway lamp was patented in 1839.",
            "Earlier safety lamps surrounded the flame with a single cylinder of wire gauze, which cooled "
            "the hot gases so that they could not ignite the air outside. Calloway used a double gauze of "
            "brass wire topped by a glass chimney. The second layer stopped the flame from passing through "
            "when a sudden draught pressed it against the mesh, which had caused several accidents with the "
            "older lamps.",
            "The lamp also served as a gas detector. When firedamp was present, a pale cap formed over the "
            "wick and the flame turned blue, warning the miner to leave the area. Overseers were taught to "
            "read the height of the cap to judge how much gas was in the air.",
            "The lamp weighed 1.4 kilograms and burned rapeseed oil for about ten hours. It was manufactured "
            "by the firm of Hollis and Vane in the town of Stourford, which made more than 90,000 of them "
            "before electric cap lamps replaced flame lamps in the 1930s. Examples are kept in the mining "
            "museum at Brackenmoor, next to the surveyor's original notebooks. "
            "A working copy is lit once a year, on the anniversary of the patent, in memory of the miners who "
            "died before safer lamps were made.",
        ],
        [
            ("Who invented the Calloway lamp?", ["Edwin Calloway", "Calloway"]),
            ("In what year was the Calloway lamp patented?", ["1839"]),
            ("What colour did the flame turn when firedamp was present?", ["blue"]),
            ("Which firm manufactured the Calloway lamp?", ["Hollis and Vane"]),
        ],
    ),
    (
        "orsella-quint",
        [
            "Orsella Quint was an astronomer known for her work on variable stars and for the comet that "
            "bears her name. She was born in 1891 in the port city of Marisca, where her father repaired "
            "ships' chronometers. As a girl she helped him set the clocks by observing star transits from "
            "the roof of his workshop.",
            "Quint studied mathematics at the University of Lindt and in 1915 joined the staff of the "
            "Kestrel Hill Observatory as a computer, checking the positions measured on photographic "
            "plates. She was promoted to assistant astronomer in 1921, the first woman to hold that post at "
            "the observatory.",
            "On the night of 3 March 1924, while comparing two plates of the same field in the constellation "
            "of the Heron, she noticed a faint smudge that had moved between exposures. The object was "
            "confirmed as a new comet two nights later and named Comet Quint. Its orbit, which she "
            "calculated herself, brings it back every 71 years.",
            "Her main work was a catalogue of 3,100 variable stars, with light curves drawn from more than "
            "twenty years of observations made with the observatory's 61-centimetre reflector. The "
            "catalogue was published in 1949 and remained a standard reference for decades. Quint retired "
            "in 1956 and died in 1967. A crater on the Moon and a lecture hall at the University of Lindt "
            "are named after her. "
            "Her observing logbooks, written in a small and very neat hand, are kept in the observatory "
            "library.",
        ],
        [
            ("Where was Orsella Quint born?", ["Marisca"]),
            ("In what year did Orsella Quint discover her comet?", ["1924"]),
            ("How many variable stars were in Orsella Quint's catalogue?", ["3,100"]),
        ],
    ),
    (
        "brightwater-handbook",
        [
            "Brightwater Foods employee handbook, section 2: working time and leave. Our head office is at "
            "14 Mill Lane, Wrenfield. The office is open from 8:30 to 17:00 on weekdays. Employees may "
            "choose their own start and finish times, but everyone is expected to be available during the "
            "core hours of 10:00 to 15:00, when most meetings are held.",
            "Full-time employees receive 26 days of annual leave per year, in addition to public holidays. "
            "Part-time employees receive a share of this in proportion to their hours. Up to five unused "
            "days may be carried over into the next year; any further unused days are lost on 31 December. "
            "Leave requests should be entered in the staff portal at least two weeks in advance and "
            "approved by your team leader.",
            "New employees complete a probation period of six months. During probation the notice period "
            "on either side is one week; after probation it is one month. Your team leader will hold a "
            "review meeting with you at the end of the third month.",
            "Work-related expenses are repaid when a claim is submitted with receipts. Expense claims must "
            "be submitted within 30 days of the purchase; later claims need the written approval of the "
            "finance manager. For problems with laptops, phones or building passes, call the help desk on "
            "extension 4400 or write to the help desk mailbox. If you are ill, tell your team leader before "
            "10:00 on the first day of absence.",
        ],
        [
            ("How many days of annual leave do full-time employees receive?", ["26 days", "26"]),
            ("How long is the probation period for new employees?", ["six months"]),
            ("What is the help desk telephone extension?", ["4400"]),
            ("Within how many days must expense claims be submitted?", ["30 days", "30"]),
        ],
    ),
    (
        "lake-dunmere",
        [
            "Lake Dunmere is the largest lake in the Askel hills, a long and narrow body of water lying in "
            "a valley carved by glaciers. It is 11 kilometres long but nowhere more than 900 metres wide. "
            "The maximum depth of Lake Dunmere is 87 metres, near the foot of the crags on its western "
            "shore.",
            "The lake is fed mainly by the River Askel, which enters at the northern end after falling "
            "through a series of small waterfalls, and it drains to the south through the River Moss. The "
            "village of Holbeck lies at the southern end of the lake, around an old stone quay. Holbeck "
            "grew up around a bobbin mill and is now a centre for walkers.",
            "The cold, clear water holds a rare fish, the Dunmere char, which survives in only two other "
            "lakes. The char spend most of the year in deep water and come into the shallows to spawn in "
            "late autumn. Fishing for them has been forbidden since 1974, and the lake is watched by "
            "volunteers during the spawning season.",
            "Since 1896 a steamer called the Lady Rowan has carried passengers between Holbeck and the "
            "northern landing at Scarth. The boat was converted from coal to oil in 1951 and now makes four "
            "return trips a day between April and October. A footpath of 26 kilometres runs around the "
            "whole lake and takes most walkers two days. "
            "In winter the lake rarely freezes over completely, but in the hard winter of 1929 the ice was thick "
            "enough for a horse fair to be held on it, an event still remembered in the name of the Holbeck inn.",
        ],
        [
            ("What is the maximum depth of Lake Dunmere?", ["87 metres", "87"]),
            ("Which river feeds Lake Dunmere?", ["River Askel", "the River Askel", "Askel"]),
            ("What is the name of the steamer on Lake Dunmere?", ["Lady Rowan", "the Lady Rowan"]),
            ("Which village lies at the southern end of Lake Dunmere?", ["Holbeck"]),
        ],
    ),
    (
        "tamsin-railway",
        [
            "The Tamsin Valley Railway is a narrow gauge railway with a track gauge of 610 millimetres. It "
            "runs for 19 kilometres from the harbour at Porth Tamsin up the valley to the old quarry "
            "village of Blaen Orrin. The line climbs 290 metres on the way and crosses the river four "
            "times.",
            "The Tamsin Valley Railway opened in 1881. It was built to carry slate from the quarries at "
            "Blaen Orrin down to ships waiting in the harbour, and for most of its working life slate made "
            "up nine tenths of its traffic. Passenger trains were added in 1884, mainly for quarrymen who "
            "lived in the lower valley.",
            "The oldest locomotive on the line is Goldcrest, a small tank engine built in 1880 by the "
            "Halden Foundry. It hauled the first train and is still in working order after a rebuild in "
            "1990. The line's other engines, Linnet and Kite, were added in 1893 and 1907.",
            "The slate trade declined after the First World War, and the railway closed in 1947. Its "
            "track was left in place but the stations fell into ruin. In 1979 a group of volunteers "
            "formed a society to restore the line, and the first section reopened in 1983. Trains now run "
            "every day in summer, and the society's workshop at Porth Tamsin repairs engines for other "
            "heritage railways.",
        ],
        [
            ("In what year did the Tamsin Valley Railway open?", ["1881"]),
            ("What did the Tamsin Valley Railway mainly carry?", ["slate"]),
            ("What is the name of the oldest locomotive on the Tamsin Valley Railway?", ["Goldcrest"]),
            ("How long is the Tamsin Valley Railway?", ["19 kilometres", "19"]),
        ],
    ),
    (
        "marrin-loom",
        [
            "The Marrin loom was an early machine for making lace. It was invented by Clara Marrin, the "
            "daughter of a weaver in the town of Tolsey, and first worked in her father's shed in 1797. "
            "Until then lace had been made entirely by hand, with a skilled worker producing only a few "
            "centimetres of fine lace in a day.",
            "The loom held 240 bobbins arranged in two curved rows. A crank turned by the operator moved "
            "the rows past each other, twisting the threads around a set of pins in a pattern controlled "
            "by a wooden drum studded with pegs. Changing the drum changed the pattern, so that a single "
            "machine could make dozens of designs.",
            "Marrin was refused a patent at first, because the officials did not believe that a woman had "
            "built the machine. She demonstrated it in public at the Tolsey guildhall in 1799 and received "
            "the patent the following year. With the help of her brother she opened a workshop that "
            "employed forty people and sold lace as far away as the capital.",
            "Hand lacemakers feared the loom, and in 1803 a crowd broke into the workshop and smashed three "
            "machines. Marrin rebuilt them and later trained several of the protesters to operate them. "
            "By the time of her death in 1841 more than 600 looms based on her design were in use. One of "
            "her original machines survives in the Tolsey town museum. "
            "It is still demonstrated there on the first Sunday of every month.",
        ],
        [
            ("Who invented the Marrin loom?", ["Clara Marrin", "Marrin"]),
            ("How many bobbins did the Marrin loom hold?", ["240"]),
            ("In which town was the Marrin loom invented?", ["Tolsey"]),
        ],
    ),
    (
        "gorran-pass",
        [
            "The Gorran Pass is a high mountain pass that links the valley of the Ebb in the north with the "
            "valley of the Sarn in the south. The elevation of the Gorran Pass is 2,314 metres, which makes "
            "it the highest road pass in the range. A small lake, frozen for most of the year, lies just "
            "below the summit.",
            "Traders have used the pass since ancient times, carrying salt south and wine north. A hospice "
            "for travellers was founded at the summit in 1146 by a community of monks, who kept a fire "
            "burning through the winter and sent dogs out to find people lost in the snow. The stone "
            "hospice building still stands and now serves as a hotel and museum.",
            "The modern road over the pass was finished in 1893. On the southern side it climbs the steep "
            "valley wall in 34 hairpin bends, each of them numbered with a painted stone. The northern "
            "approach is longer and gentler, following a shelf cut into the rock above the Ebb gorge.",
            "Because of heavy snow, the road is closed from November to May. In summer it is popular with "
            "cyclists, and an annual race from the town of Vallor up to the hospice draws several thousand "
            "riders. Since 1962 a rail tunnel beneath the mountain has carried most of the freight that "
            "once crossed the pass. "
            "Walkers can still follow the old mule track, which climbs more directly than the road and passes the "
            "ruins of a customs house where travellers once paid a toll on every load of salt.",
        ],
        [
            ("What is the elevation of the Gorran Pass?", ["2,314 metres", "2,314"]),
            ("In what year was the hospice at the Gorran Pass founded?", ["1146"]),
            ("How many hairpin bends does the road have on the southern side?", ["34"]),
        ],
    ),
    (
        "marrowfield-fair",
        [
            "The Marrowfield Cheese Fair is held every year on the second Saturday of October in the market "
            "square of Marrowfield. The fair has been held since 1732, when the lord of the manor granted "
            "the town the right to hold a cheese market free of tolls. It is now one of the oldest food "
            "fairs in the country and draws about 15,000 visitors.",
            "More than a hundred makers bring their cheeses to the fair. The best known is Marrowfield "
            "Blue, a soft blue cheese made from the milk of cows grazing on the water meadows along the "
            "River Wend. Only eleven farms are allowed to use the name, and each cheese is matured for at "
            "least ten weeks in cool cellars.",
            "A panel of judges tastes the entries in the morning. The prize for the best cheese of the fair "
            "is called the Silver Wheel, a silver plate in the shape of a cheese that the winner keeps for "
            "a year. The maker who wins it three times in a row is given a small copy to keep.",
            "In the afternoon comes the cheese-rolling race down Tanner's Hill, a steep grassy slope at "
            "the edge of the town. Runners chase a wheel of cheese weighing four kilograms down the hill, "
            "and the first to reach the bottom wins the cheese. The day ends with a procession of lanterns "
            "through the square. "
            "Stalls selling bread, cider and pickles line the surrounding streets, and the money raised by the fair "
            "pays for the upkeep of the old market hall, where the cheeses are stored overnight before judging.",
        ],
        [
            ("Since what year has the Marrowfield Cheese Fair been held?", ["1732"]),
            ("What is the prize for the best cheese at the fair called?", ["the Silver Wheel", "Silver Wheel"]),
            ("Down which hill is the cheese-rolling race held?", ["Tanner's Hill"]),
        ],
    ),
    (
        "aurelie",
        [
            "The Aurelie is a paddle steamer that worked on the River Sable for more than thirty years. She "
            "was built in 1903 at the Dorrick boatyard and launched sideways into the river in front of a "
            "large crowd. The Aurelie is 46 metres long, with a paddle wheel on each side driven by a "
            "two-cylinder steam engine.",
            "The Aurelie could carry 350 passengers on her two decks. She sailed daily between the city of "
            "Amberley and the seaside town of Lisle Ferry, a journey of about five hours, stopping at "
            "villages along the way. On summer evenings she also ran dance cruises with a band on the upper "
            "deck.",
            "For 31 years the Aurelie was commanded by Captain Jonas Pettigrew, who was known along the "
            "river for his red waistcoat and his habit of greeting every landing with three blasts of the "
            "whistle. He retired in 1936, two years before the end of her working life.",
            "In the winter of 1938 the Aurelie broke her moorings during a storm and sank in shallow water "
            "near Lisle Ferry. She lay in the mud for more than fifty years. A preservation trust raised "
            "the hull in 1991 and spent twelve years restoring her. She is now moored at Lisle Ferry as a "
            "floating museum and makes short trips on a few days each summer. "
            "Volunteers keep the engine in steam and sell tickets from the original booking office. "
            "Her old whistle, which Captain Pettigrew sounded at every landing, was recovered from the wreck "
            "and still works.",
        ],
        [
            ("In what year was the Aurelie built?", ["1903"]),
            ("How many passengers could the Aurelie carry?", ["350"]),
            ("Who commanded the Aurelie for 31 years?", ["Captain Jonas Pettigrew", "Jonas Pettigrew", "Pettigrew"]),
        ],
    ),
    (
        "oskan-language",
        [
            "Oskan is a language spoken by about 40,000 people in the Osk Highlands, a region of high "
            "plateaus and deep river valleys. Most speakers also speak the national language, but Oskan "
            "remains the language of the home in many mountain villages and is taught in local primary "
            "schools.",
            "Oskan has its own alphabet of 27 letters, created in the eighteenth century by a village "
            "priest who adapted the letters of a neighbouring script. Several letters stand for sounds "
            "that do not exist in the national language, such as a whistled s used in a handful of words.",
            "The first Oskan dictionary was compiled by Ilse Varga, a schoolteacher who spent nine years "
            "walking from village to village to record the words used by shepherds, weavers and "
            "charcoal burners. Her dictionary was printed in 1912 and contains about 18,000 entries.",
            "Many Oskan words describe water and weather. The Oskan word for river is venn, and there are "
            "separate words for a river in flood, a frozen river and a river that runs dry in summer. "
            "Since 1995 an Oskan radio station has broadcast news and music for two hours every day, and "
            "a yearly song contest helps to keep the language alive among young people. "
            "Linguists disagree about the origin of Oskan. Some link it to the languages of the eastern steppes, "
            "while others believe that it is the last survivor of a family of languages once spoken across the whole "
            "mountain range.",
        ],
        [
            ("How many letters does the Oskan alphabet have?", ["27"]),
            ("Who compiled the first Oskan dictionary?", ["Ilse Varga", "Varga"]),
            ("What is the Oskan word for river?", ["venn"]),
            ("About how many people speak Oskan?", ["40,000"]),
        ],
    ),
    (
        "tessellate",
        [
            "Tessellate is a board game for two to four players in which each player lays hexagonal tiles "
            "to build a landscape of forests, lakes and fields. It was invented by Rupert Ashdown, a "
            "surveyor who designed the first version on the back of a map while snowed in at a mountain "
            "hut.",
            "Tessellate was first published in 1961 by Bellweather Games, a small company in the city of "
            "Norhaven that until then had made jigsaw puzzles. A Tessellate set contains 64 hexagonal "
            "tiles, four wooden pawns and a cloth bag from which the tiles are drawn. Players score points "
            "for every complete region they close off, and a game usually lasts about forty minutes.",
            "The game sold slowly at first, but after it won a toy fair prize in 1964 demand grew so fast "
            "that Bellweather Games moved to a larger factory. More than 12 million copies have since been "
            "sold in thirty languages, and the company now makes nothing else.",
            "A world championship has been held every year since 1978, in the city of Cordale. Players "
            "qualify through national tournaments, and the final is played with a special set of tiles "
            "made from oak. The most successful player in its history, Mirela Voss, won the title five "
            "times. Fans of the game also play it by post and online, and clubs meet in cafes and libraries to "
            "try new tile sets designed by players, some of which the company has later sold as expansions. "
            "The original drawing on the back of the map now hangs in the company's office.",
        ],
        [
            ("Who invented Tessellate?", ["Rupert Ashdown", "Ashdown"]),
            ("How many tiles are in a Tessellate set?", ["64"]),
            ("Which company first published Tessellate?", ["Bellweather Games"]),
            ("In which city is the Tessellate world championship held?", ["Cordale"]),
        ],
    ),
    (
        "silver-fernwort",
        [
            "The silver fernwort is a small flowering plant that grows only on the limestone cliffs of the "
            "Carrow Gorge. It forms low cushions in cracks in the rock, usually on ledges facing north "
            "where the spray from the river keeps the air damp. The whole population covers an area "
            "smaller than a football field.",
            "The plant grows to a height of about 20 centimetres. Its leaves are divided like those of a "
            "fern and are covered in fine silver hairs, which give the plant its name and help it to hold "
            "on to moisture. The silver fernwort flowers in June, producing small pale yellow flowers with "
            "five petals that are visited by a single kind of solitary bee.",
            "The silver fernwort was first described in 1854 by the botanist Agnes Mowbray, who was "
            "lowered down the cliffs on a rope by two quarrymen to collect a specimen. She sent it to the "
            "herbarium at Wenmouth, where it is still kept in a glass case.",
            "Collectors dug up many plants in the nineteenth century, and by 1950 fewer than three hundred "
            "remained. The plant has been protected by law since 1975. Seeds are now stored in a seed bank, "
            "and young plants raised from them have been planted back on the cliffs by climbers working for "
            "the conservation trust. "
            "Visitors can see the plant from a viewing platform on the opposite side of the gorge, where a telescope "
            "is fixed on the largest cushion during the flowering season. "
            "Rangers ask visitors not to climb on the cliffs, because a single careless step can destroy a "
            "plant that took twenty years to grow.",
        ],
        [
            ("Who first described the silver fernwort?", ["Agnes Mowbray", "Mowbray"]),
            ("Where does the silver fernwort grow?", ["Carrow Gorge", "the Carrow Gorge"]),
            ("In which month does the silver fernwort flower?", ["June"]),
        ],
    ),
    (
        "halvard-college",
        [
            "Halvard College is one of the oldest colleges in the city of Wenmouth. It was founded in 1621 "
            "by Tobias Halvard, a wool merchant who left most of his fortune to educate the sons of poor "
            "families from his home district. Today the college admits about 600 students a year, men and "
            "women, from all over the world.",
            "The college buildings stand around three courtyards. The oldest, the Founder's Court, contains "
            "the chapel and the dining hall, whose roof is made of oak beams taken from a ship. The library "
            "holds about 400,000 volumes, including a collection of early atlases donated by a former "
            "student.",
            "The college colours are green and gold, and they appear on the scarves and blazers worn by its "
            "sports teams. Every spring the college crew races the crew of its old rival, Sutton Hall, on "
            "the river below the city walls. The race has been rowed every year since 1829, except during "
            "the two world wars.",
            "Famous members of the college include the poet Ansel Grey and the engineer Matthew Roan, who "
            "designed the city's first waterworks. The head of the college has the title of Warden and is "
            "elected by the fellows for a term of ten years. "
            "Visitors may walk through the courtyards in the afternoons, and the chapel choir sings an evening service "
            "that is open to the public during term. "
            "The dining hall has appeared in several films, and its portraits of past Wardens are among the "
            "oldest paintings in the city.",
        ],
        [
            ("Who founded Halvard College?", ["Tobias Halvard", "Halvard"]),
            ("In what year was Halvard College founded?", ["1621"]),
            ("What are the colours of Halvard College?", ["green and gold"]),
            ("What is the title of the head of Halvard College?", ["Warden"]),
        ],
    ),
    (
        "corran-point",
        [
            "The Corran Point Lighthouse stands on a granite headland at the entrance to Corran Bay, where "
            "a chain of hidden rocks had wrecked dozens of ships. The lighthouse was built in 1829 by the "
            "harbour board after a winter in which four ships were lost within a single month.",
            "The tower is 31 metres tall and built of dressed granite blocks, painted white with a single "
            "red band below the lantern. A spiral staircase of 142 steps leads to the lamp room. The light "
            "flashes white every 10 seconds and can be seen from 22 nautical miles away in clear weather. "
            "In fog a horn sounds twice every minute.",
            "For more than a century the lighthouse was kept by members of the Tregarth family, who lived "
            "in the cottages at its foot. The last keeper, Hannah Tregarth, kept a logbook in which she "
            "recorded every ship that passed, as well as the birds that crashed into the lantern on dark "
            "nights.",
            "The lighthouse was automated in 1987, and the light is now monitored from the coastguard "
            "station at Penrock. The keepers' cottages have been turned into a small museum, and visitors "
            "can climb the tower on summer weekends to see the great glass lens, which was made in 1871 "
            "and weighs about three tonnes. "
            "Hannah Tregarth's logbook is displayed in the museum beside the brass lamp that her grandfather used. "
            "From the gallery at the top of the tower, seals can often be seen resting on the rocks that once "
            "made the bay so dangerous, and on clear days the coast can be followed for many miles in both "
            "directions.",
        ],
        [
            ("How tall is the Corran Point Lighthouse?", ["31 metres", "31"]),
            ("In what year was the Corran Point Lighthouse automated?", ["1987"]),
            ("How often does the Corran Point light flash?", ["every 10 seconds", "10 seconds"]),
            ("Who was the last keeper of the Corran Point Lighthouse?", ["Hannah Tregarth", "Tregarth"]),
        ],
    ),
    (
        "wendle-clocks",
        [
            "Wendle is a small town in a forested valley that has been known for its clocks since the early "
            "eighteenth century. Farmers in the valley began making wooden clocks during the long winters, "
            "when the snow kept them indoors, and pedlars carried the clocks on their backs to sell them in "
            "distant cities.",
            "The Wendle clockmakers' guild was founded in 1764 to set standards for the trade. Every "
            "apprentice had to build a complete clock, known as the masterpiece, before being admitted to "
            "the guild. At its height the guild had more than 300 members, and the town exported tens of "
            "thousands of clocks a year.",
            "The most famous clock in the town is the Great Astronomical Clock in the town hall, built by "
            "Peter Aumann in 1790. Besides the time, its dials show the phases of the Moon, the positions of "
            "the planets and the date of Easter for every year until 2100. A procession of carved figures "
            "appears at noon each day.",
            "Factory-made clocks from abroad ended the home industry in the late nineteenth century, but a "
            "few workshops survive and still build clocks by hand. The clock museum of Wendle holds 1,200 "
            "clocks, from simple wooden wall clocks to musical clocks that play tunes on small organ "
            "pipes. Its restorers train young clockmakers in a workshop that visitors can watch through a "
            "window. "
            "Each autumn the town holds a clock fair at which collectors buy and sell old "
            "clocks and spare parts. "
            "A clockmakers' trail with painted signs leads walkers from the town hall to the workshops in the "
            "surrounding villages.",
        ],
        [
            ("Who built the Great Astronomical Clock of Wendle?", ["Peter Aumann", "Aumann"]),
            ("In what year was the Wendle clockmakers' guild founded?", ["1764"]),
            ("How many clocks does the Wendle clock museum hold?", ["1,200"]),
        ],
    ),
    (
        "northwind-travel",
        [
            "Northwind Logistics staff handbook, chapter 5: business travel. This chapter applies to all "
            "employees who travel for work, including trainees and contractors. Every trip must be approved "
            "in advance by your line manager. Once a trip is approved, book all tickets and hotels through "
            "our booking system, called Compass, so that the travel desk can find you in an emergency.",
            "Travel by train whenever the journey takes less than five hours; book standard class unless "
            "the journey takes more than three hours. Flights are allowed only for longer journeys and must "
            "be booked in economy class. If you use your own car, you are paid a mileage rate of 0.38 euros "
            "per kilometre, which covers fuel, wear and insurance.",
            "The maximum hotel cost is 140 euros per night, including breakfast. In the capital and in "
            "cities abroad the limit rises to 180 euros. You receive a daily meal allowance of 45 euros "
            "for each full day away from home. Alcohol is not repaid, except at events where you are "
            "hosting customers.",
            "Keep all receipts and submit your travel claim in Compass within two weeks of your return. If "
            "something goes wrong during a trip, such as a cancelled flight or a lost passport, call the "
            "travel desk on its emergency number, which is answered at any hour. Questions about this "
            "policy can be sent to the finance team in Harlow House. "
            "Travel insurance is arranged by the company for every approved trip, so there is no need to buy your "
            "own cover. "
            "Report any accident or illness during a trip to the travel desk as soon as you can.",
        ],
        [
            ("What is the maximum hotel cost per night?", ["140 euros", "140"]),
            ("What is the name of the booking system?", ["Compass"]),
            ("What is the daily meal allowance?", ["45 euros", "45"]),
        ],
    ),
    (
        "teodor-lisk",
        [
            "Teodor Lisk was a composer and cellist. He was born in 1902 in Brenholm, a fishing town on a "
            "windy northern coast, where his mother led the church choir. He learned the cello from a "
            "travelling musician who spent a winter in the town, and by the age of twelve he was playing in "
            "the orchestra of the nearest city.",
            "Lisk studied at the Meridian Conservatory, where he later taught composition for almost thirty "
            "years. His early works are short pieces for cello and piano, many of them based on the sea "
            "songs he had heard as a child. In his thirties he turned to larger forms and wrote seven "
            "symphonies, the last of them completed a few months before his death in 1971.",
            "His best known work is the opera The Glass Orchard, first performed in 1936. It tells the "
            "story of a gardener who grows trees of glass for a king and loses his sight from the glare. "
            "The opening night was received coldly, but a revival after the war made it a favourite, and it "
            "has since been staged in more than twenty countries.",
            "Lisk disliked public attention and spent his summers in a small cabin near Brenholm, where he "
            "did most of his writing. His manuscripts, letters and his own cello are kept in the library of "
            "the Meridian Conservatory, which holds a festival of his music every five years. "
            "Recordings of his cello sonatas, made by his own pupils, are still in print. "
            "A small statue of the composer with his cello looks out over the harbour of his home town.",
        ],
        [
            ("Where was Teodor Lisk born?", ["Brenholm"]),
            ("What is the name of Teodor Lisk's opera?", ["The Glass Orchard", "Glass Orchard"]),
            ("How many symphonies did Teodor Lisk write?", ["seven"]),
            ("What instrument did Teodor Lisk play?", ["the cello", "cello"]),
        ],
    ),
    (
        "lumen-3",
        [
            "Lumen-3 was a small space probe that used a solar sail to travel to a near-Earth asteroid. It "
            "was built by the Meridian Space Consortium, a group of universities, and launched in 2031 as a "
            "secondary payload on a rocket carrying a weather satellite.",
            "The probe had a mass of 420 kilograms at launch. Once in space it unfolded a square sail of "
            "aluminium-coated plastic with an area of 1,600 square metres, thinner than a human hair. The "
            "gentle push of sunlight on the sail slowly changed the probe's orbit, so that it needed no fuel "
            "for the cruise. Small vanes at the corners of the sail were used to steer.",
            "The target of Lumen-3 was the asteroid Pelagia, a rocky body about 900 metres across. The probe "
            "reached Pelagia in 2036 after a cruise of five years and flew alongside it for eight months. "
            "Its cameras mapped the whole surface, finding a chain of craters and boulders the size of "
            "houses, and its instruments measured the asteroid's weak gravity.",
            "The mission ended in 2037, when the sail was turned to drop the probe into a slow orbit around "
            "the Sun. Engineers described the solar sail as the mission's main success, and the team used "
            "what they learned to design a larger sail for a later probe. "
            "A full-size copy of the folded probe, no larger than a washing machine, is on display at the "
            "consortium's visitor centre, next to a piece of the sail material that visitors may touch.",
        ],
        [
            ("In what year was Lumen-3 launched?", ["2031"]),
            ("Which asteroid did Lumen-3 visit?", ["Pelagia"]),
            ("What was the mass of Lumen-3 at launch?", ["420 kilograms", "420"]),
        ],
    ),
    (
        "ringball",
        [
            "Ringball is a team sport in which players pass a leather ball by hand and try to throw it "
            "through a ring mounted on a pole at each end of the field. It was invented in 1897 by Hugh "
            "Farrant, a schoolteacher at Elmsworth School, who wanted a game that his pupils could play in "
            "the narrow yard behind the school.",
            "A ringball team has seven players. Players may not run while holding the ball; they must pass "
            "it within three seconds of catching it. The ring is 2 metres above the ground and 45 "
            "centimetres across, and a throw through the ring scores one point. A match has two halves of "
            "25 minutes each, with a break of ten minutes.",
            "The game spread quickly to other schools and then to clubs. The International Ringball "
            "Federation was founded in 1950 in the city of Laurentz and now has 38 member countries. It "
            "organises a world cup every four years, which has been won most often by the national team of "
            "Estravia.",
            "Ringball is played by men and women, often in mixed teams at school level. Because it needs "
            "little equipment and a small field, it is popular in cities, and indoor versions are played "
            "during the winter in sports halls. "
            "Many players of other ball games take up ringball to improve their passing. The oldest surviving ring, "
            "made of bent ash wood by Farrant himself, hangs in the entrance hall of Elmsworth School. "
            "Pupils at the school still play the game every day in the same narrow yard.",
        ],
        [
            ("Who invented ringball?", ["Hugh Farrant", "Farrant"]),
            ("How many players are on a ringball team?", ["seven"]),
            ("How long is each half of a ringball match?", ["25 minutes", "25"]),
        ],
    ),
    (
        "ashcombe-library",
        [
            "The Ashcombe Library is the main public library of the town of Ashcombe. It opened in 1894 in a "
            "building paid for by Sarah Penhallow, the owner of the town's largest cotton mill, who had "
            "taught herself to read from borrowed books and wanted every worker in the town to have free "
            "access to them.",
            "The building was designed by the architect Lionel Marsh in a plain classical style. Its best "
            "known feature is the round reading room beneath a glass dome, where 120 readers can sit at "
            "desks arranged in rings. The dome was damaged by a storm in 1952 and rebuilt with the original "
            "iron frame.",
            "The library holds about 180,000 books. It also keeps a collection of more than 3,000 old maps "
            "of the district, some of them drawn by hand by surveyors of the mill company, and a complete "
            "run of the town newspaper since its first issue. Local historians use these collections to "
            "trace the history of streets and families.",
            "The library is open every day except Sunday. Membership is free for everyone who lives or "
            "works in Ashcombe, and the library runs reading groups, language classes and a small "
            "workshop where volunteers repair damaged books. A statue of Sarah Penhallow holding an open "
            "book stands by the entrance. "
            "Every year on the anniversary of the opening, the children of the town are invited to borrow their first "
            "book and have their names written in a large register kept in the reading room. "
            "Some of the oldest names in the register belong to mill workers who joined in the first week.",
        ],
        [
            ("Who paid for the Ashcombe Library building?", ["Sarah Penhallow", "Penhallow"]),
            ("In what year did the Ashcombe Library open?", ["1894"]),
            ("How many books does the Ashcombe Library hold?", ["180,000"]),
            ("Who designed the Ashcombe Library building?", ["Lionel Marsh", "Marsh"]),
        ],
    ),
]


def rows() -> list[dict]:
    """One row per question, the article text repeated as its context."""
    out = []
    for slug, paragraphs, questions in ARTICLES:
        context = "\n\n".join(paragraphs)
        for number, (question, answers) in enumerate(questions, start=1):
            missing = [answer for answer in answers if answer not in context]
            if missing:
                raise SystemExit(f"{slug}: answers not in the text: {missing}")
            out.append({"id": f"{slug}-{number}", "context": context, "question": question, "answers": answers})
    return out


def main() -> None:
    data = rows()
    with OUT.open("w", encoding="utf-8") as handle:
        for row in data:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(ARTICLES)} contexts, {len(data)} questions)")


if __name__ == "__main__":
    main()
