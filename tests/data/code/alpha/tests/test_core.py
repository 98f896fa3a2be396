def check_value(value):
    return value == 1
