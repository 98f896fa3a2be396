async def fetch_page(client, url):
    response = await client.get(url)
    return response.text
