def load_items(path):
    with open(path) as f:
        return [line.strip() for line in f]


def add_one(value):
    return value + 1
