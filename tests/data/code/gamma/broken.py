def fine_function(a, b):
    return a * b

def broken(:
    pass
